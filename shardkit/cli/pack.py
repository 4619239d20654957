"""`shardkit pack`: an image folder, a manifest or a dataset into shards (or an LMDB) under DEST."""

from __future__ import annotations

import time

import click

from .. import formats
from ..errors import SourceError
from ..tools import report
from .options import OnErrorChoice, byte_size, errors_to_exit, examples, parse_storage_options, storage_option


@click.command(
    epilog=examples(
        "shardkit pack ./photos ./photos-shards --max-size 256MB --workers 4",
        "shardkit pack ./captioned ./caption-shards --layout flat   # no class folders",
        "shardkit pack ./photos s3://bucket/photos -o endpoint_url=http://127.0.0.1:9000",
    )
)
@click.argument("src")
@click.argument("dest")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(formats.FORMATS),
    default=formats.DEFAULT,
    show_default=True,
    help="Output format: WebDataset tar shards, or one LMDB (local random access).",
)
@click.option("--max-count", type=click.IntRange(min=1), help="At most this many samples per shard.")
@click.option(
    "--max-size",
    default="256MB",
    show_default=True,
    callback=byte_size,
    help="At most this many bytes per shard (256MB, 1GiB, ...; tar: at least 10KiB).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes writing shards in parallel (cores no shard keeps busy, with fewer shards "
    "than that or at a pack's end, take on the --resize or --decode-check work of the "
    "shards still going).  [default: CPU count]",
)
@click.option(
    "--shuffle/--no-shuffle",
    default=True,
    show_default=True,
    help="Shuffle samples across shards (recommended for training).",
)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the pack-time shuffle.")
@click.option(
    "--on-error",
    type=OnErrorChoice(),
    default="skip",
    show_default=True,
    help="Skip unusable files (listed in the index) or stop at the first one.",
)
@click.option(
    "--resize",
    type=click.IntRange(min=1),
    metavar="PX",
    help="Shrink each image so its shorter side is at most PX, re-encoded as JPEG.",
)
@click.option(
    "--quality",
    type=click.IntRange(1, 100),
    metavar="Q",
    help="Re-encode images as JPEG at this quality (default 90 with --resize).",
)
@click.option(
    "--decode-check",
    is_flag=True,
    help="Decode every image in full (a slower pack), so that a corrupt one is skipped now, not met in training.",
)
@click.option(
    "--max-file-size",
    default="1GiB",
    show_default=True,
    callback=byte_size,
    help="Skip (or, with --on-error raise, stop at) a source image larger than this, unread.",
)
@click.option(
    "--layout",
    type=click.Choice(["classes", "flat"]),
    default="classes",
    show_default=True,
    help="Images in class folders (SRC/<class>/<image>), or anywhere under SRC without classes.",
)
@click.option(
    "--fields",
    default="",
    metavar="EXT,...",
    help="More sidecar extensions to pack with each image (photo.depth.png: depth.png), besides txt, json, "
    "cls and seg.png.",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Run the per-shard jobs on a local process pool or as Ray tasks on a cluster.",
)
@click.option("--ray-address", metavar="ADDRESS", help="Ray cluster to join (e.g. auto); default: a local one.")
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace a finished dataset in DEST made from another source or with other options.",
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No progress bar and no summary; unusable files skipped still get one line on stderr.",
)
@storage_option
@errors_to_exit
def pack(
    src: str,
    dest: str,
    fmt: str,
    max_count: int | None,
    max_size: int | None,
    workers: int | None,
    shuffle: bool,
    seed: int,
    on_error: str,
    resize: int | None,
    quality: int | None,
    decode_check: bool,
    max_file_size: int | None,
    layout: str,
    fields: str,
    executor: str,
    ray_address: str | None,
    overwrite: bool,
    quiet: bool,
    storage_options: tuple[str, ...],
) -> None:
    """Pack the image folder SRC (SRC/<class>/<image>) into shards under DEST.

    Files beside an image that share its name (photo.txt, photo.json, photo.cls,
    photo.seg.png, and --fields) become fields of its sample. SRC may be a manifest
    instead (train.csv or train.jsonl: an image path, relative to it, and label, caption
    and other columns a row).

    SRC may also be a shardkit dataset (tar shards or an LMDB) to convert to --format;
    every sample is copied byte for byte, in order. Deterministic and safe to rerun: after
    an interruption the same command keeps the finished work and writes the rest.
    index.json is written last. A finished dataset already in DEST from another source or
    with other options is left alone unless --overwrite is given.
    """
    from ..packing.pack import pack as run_pack
    from ..packing.sinks import sink_for
    from ..storage import join

    if ray_address is not None and executor != "ray":
        raise click.UsageError("--ray-address needs --executor ray")
    sink = sink_for(fmt)
    if max_size is not None and max_size < sink.min_size:
        raise click.BadParameter(f"at least {sink.min_size_note}, not {max_size} bytes", param_hint="'--max-size'")

    start = time.perf_counter()
    stats: dict[str, int] = {}
    try:
        idx = run_pack(
            src,
            dest,
            format=fmt,
            max_count=max_count,
            max_size=max_size,
            workers=workers,
            shuffle=shuffle,
            seed=seed,
            on_error=on_error,
            resize=resize,
            quality=quality,
            decode_check=decode_check,
            max_file_size=max_file_size,
            layout=layout,
            fields=[f for f in fields.split(",") if f.strip()],
            progress=None if not quiet else False,
            executor=executor,
            ray_address=ray_address,
            storage_options=parse_storage_options(storage_options),
            overwrite=overwrite,
            stats=stats,
        )
    except SourceError as e:
        if on_error == "raise" and str(e).startswith(join(src, "")):  # a file of SRC it could not use
            raise SourceError(
                f"{e} (--on-error raise; remove the file, or pack with --on-error skip to leave it out "
                "and list it in the index)"
            ) from None
        raise
    if not quiet:
        click.echo(report.pack_summary(idx, dest, stats, time.perf_counter() - start))
    for line in report.pack_warnings(idx, dest, layout, quiet):
        click.echo(line, err=True)
