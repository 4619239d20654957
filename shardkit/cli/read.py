"""The commands that read a dataset: `info`, `verify`, `index` (writes an index.json for
shards made elsewhere) and `preview`."""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import click

from .. import formats
from ..errors import CorruptShardError, ShardkitError
from ..tools import report
from .options import (
    errors_to_exit,
    examples,
    output_file,
    parse_storage_options,
    read_error_option,
    storage_option,
    transform_option,
)


@click.command(
    epilog=examples(
        "shardkit info ./photos-shards",
        "shardkit info s3://bucket/photos --json",
        "shardkit info s3://bucket/photos -v -o endpoint_url=http://127.0.0.1:8333",
    )
)
@click.argument("url")
@click.option("--json", "as_json", is_flag=True, help="Print the whole index as JSON.")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="Also say what reads the shards and how: for S3, the endpoint, addressing style, region, "
    "checksums and client shardkit chose, and why.",
)
@storage_option
@errors_to_exit
def info(url: str, as_json: bool, verbose: bool, storage_options: tuple[str, ...]) -> None:
    """Summarise the dataset at URL from its index.json."""
    from .. import index
    from ..storage import display

    opts = parse_storage_options(storage_options)
    idx = index.load(url, opts)
    if as_json:
        click.echo(idx.to_json(), nl=False)
        return
    for line in report.info_lines(idx, display(url)):
        click.echo(line)
    if verbose:
        _describe_store(url, idx, opts)


def _describe_store(url: str, idx: Any, storage_options: dict[str, Any] | None) -> None:
    """What reads the dataset's shards, and how (its first shard's store: one dataset, one store)."""
    from ..storage import join
    from ..storage.stores import store_for

    first = join(url, "") + idx.shards[0].name if formats.get(idx.kind).sharded and idx.shards else url
    for line in report.store_lines(store_for(first, storage_options).describe(first)):
        click.echo(line)


@click.command(
    epilog=examples("shardkit verify ./photos-shards", "shardkit verify ./photos-shards --decode --workers 4")
)
@click.argument("url")
@click.option("-q", "--quiet", is_flag=True, help="Print problems only.")
@click.option(
    "--decode",
    is_flag=True,
    help="Then decode every image in full (DataLoader workers; needs PyTorch) and name each one that does not decode.",
)
@click.option(
    "--workers", type=click.IntRange(min=0), metavar="N", help="DataLoader workers for --decode.  [default: CPU count]"
)
@storage_option
@errors_to_exit
def verify(url: str, quiet: bool, decode: bool, workers: int | None, storage_options: tuple[str, ...]) -> None:
    """Re-read every shard and check size, sha256, sample count and offsets against the index.

    For an LMDB: every sample of the index present with its recorded byte count, and no
    stray records. Exits 1 naming every bad shard. With --decode, every image is then
    decoded too (damaged pixel data between intact ends passes the checks above), and
    each one that does not decode is named by shard, sample and field.
    """
    from ..formats.lmdb import DATA_FILE as LMDB_DATA_FILE
    from ..storage import display
    from ..tools.verify import undecodable
    from ..tools.verify import verify as run_verify

    if workers is not None and not decode:
        raise click.UsageError("--workers goes with --decode")
    if decode and importlib.util.find_spec("torch") is None:  # before the byte checks, which may take hours
        raise click.UsageError("--decode reads through PyTorch, which is not installed: pip install torch")

    unhashed = []  # shards whose index entry has no sha256 (a hand-made index): their bytes go unchecked
    checked: list[str] = []

    def on_shard(info: Any, problem: str | None) -> None:
        checked.append(info.name)
        unchecked = (
            problem is None and info.sha256 is None and info.offsets is not None
        )  # a tar shard (an LMDB has neither)
        if unchecked:
            unhashed.append(info.name)
        if not quiet and problem is None:
            click.echo(report.verify_ok(info.name, info.samples, unchecked))

    problems = run_verify(url, parse_storage_options(storage_options), on_shard=on_shard)
    lmdb = checked == [LMDB_DATA_FILE]  # an LMDB is one file, not shards
    for p in problems:
        click.echo(f"BAD  {p}", err=True)
    if problems:
        raise click.ClickException(
            report.verify_failure(len(problems), LMDB_DATA_FILE if lmdb else None, display(url), decode)
        )
    if unhashed:
        click.echo(report.unhashed_note(len(unhashed)), err=True)
    if not quiet:
        click.echo(f"{LMDB_DATA_FILE} matches the index" if lmdb else "all shards match the index")
    if decode:
        bad = undecodable(url, parse_storage_options(storage_options), workers)
        for p in bad:
            click.echo(f"BAD  {p}", err=True)
        if bad:
            raise click.ClickException(report.undecodable_failure(len(bad), display(url)))
        if not quiet:
            click.echo("every image decodes")


@click.command(
    "index", epilog=examples("shardkit index ./webdataset-shards", "shardkit index s3://bucket/photos --versions")
)
@click.argument("url")
@click.option(
    "--force",
    is_flag=True,
    help="Rebuild an existing index.json from the shards (keeping its class names and list of skipped files).",
)
@click.option(
    "--upgrade",
    is_flag=True,
    help="Rewrite an index.json of version 1 as version 2 (sample offsets in a file beside it), reading no shard.",
)
@click.option(
    "--versions",
    is_flag=True,
    help="Only record each remote shard's current version (ETag, generation) in an existing index.json, "
    "for a dataset copied elsewhere: one listing, no shard read.",
)
@storage_option
@errors_to_exit
def index_cmd(url: str, force: bool, upgrade: bool, versions: bool, storage_options: tuple[str, ...]) -> None:
    """Write index.json for tar shards (.tar, .tar.gz, .tgz) made by another tool (webdataset,
    plain tar), with each remote shard's version, which readers check to catch a shard
    replaced under its name."""
    from dataclasses import replace

    from .. import index, storage
    from ..index.resolve import build_index, shard_urls

    opts = parse_storage_options(storage_options)
    if upgrade + force + versions > 1:
        raise click.UsageError(
            "--upgrade rewrites index.json as it is, --versions records the shards' versions in "
            "it, --force rebuilds it from the shards: give one"
        )
    if upgrade:
        _upgrade(url, opts)
        return
    old = None
    if versions:
        idx = index.pinned(index.load(url, opts), url, opts)
        index.save(idx, url, opts)
        click.echo(report.versions_recorded(idx))
        return
    if storage.exists(storage.join(url, index.INDEX_NAME), opts):
        if not force:
            raise click.ClickException(f"{storage.join(url, index.INDEX_NAME)} exists (use --force to rebuild)")
        with contextlib.suppress(ShardkitError, OSError):  # one that cannot be read has nothing to keep
            old = index.load(url, opts)
    else:
        index.check_finished(url, opts)  # a shardkit pack's own shards: finished by rerunning it, not indexed
    idx = index.pinned(build_index(shard_urls(url, opts), opts), url, opts)
    if (
        old is not None and formats.get(old.kind).sharded
    ):  # what the shards cannot tell; not the plan, which vouches for bytes
        idx = replace(idx, classes=old.classes, skipped=old.skipped)
    index.save(idx, url, opts)
    click.echo(report.indexed(idx))


def _upgrade(url: str, opts: dict[str, Any] | None) -> None:
    from .. import index

    idx = index.load(url, opts)
    already = report.nothing_to_upgrade(idx, index.INDEX_NAME)
    if already is not None:
        click.echo(already)
        return
    saved = index.save(idx, url, opts)
    assert saved.offsets_file is not None
    click.echo(report.upgraded(idx, saved, index.INDEX_NAME, index.VERSION))


@click.command(epilog=examples("shardkit preview ./photos-shards --n 16 --out batch.png"))
@click.argument("url")
@click.option("--n", "n", type=click.IntRange(min=1), default=16, show_default=True, help="Samples to show.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    default="batch.png",
    show_default=True,
    callback=output_file,
    help="Image file to write (PNG, or the format its extension names: .jpg, .webp).",
)
@transform_option
@click.option(
    "--decode",
    type=click.Choice(["raw", "pil", "rgb8", "tensor"]),
    default="tensor",
    show_default=True,
    help="How images are decoded before the transform (bench's default too, so one --transform serves both).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Shuffle seed: which samples are shown.")
@click.option(
    "--tile", type=click.IntRange(min=16), default=128, show_default=True, metavar="PX", help="Pixels per image square."
)
@read_error_option
@storage_option
@errors_to_exit
def preview(
    url: str,
    n: int,
    out: str,
    transform: Any,
    decode: str,
    seed: int,
    tile: int,
    on_error: str,
    storage_options: tuple[str, ...],
) -> None:
    """Draw N shuffled samples of URL (after --transform) as a labelled PNG grid.

    Each tile shows the image (a CHW tensor, an HWC array or a PIL image, or the first
    element of a tuple the transform returns) with its class name and key.
    """
    from ..tools.preview import render_preview

    try:
        result = render_preview(
            url,
            n=n,
            out=out,
            transform=transform,
            decode=decode,
            seed=seed,
            tile=tile,
            storage_options=parse_storage_options(storage_options),
            on_error=on_error,
        )
    except CorruptShardError as e:
        raise click.ClickException(report.in_cli_words(report.message(e))) from None
    click.echo(report.preview_written(out, result))
