"""`shardkit` command line: thin click wrappers over the Python API.

Exit codes: 0 success, 1 a shardkit error (bad input, corrupt shard; the message names it),
2 a usage error (click's convention).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from . import formats
from .checks import ON_ERROR
from .errors import CorruptShardError, ShardkitError, SourceError, one_line, redact, shown_name
from .interrupts import exit_on_second_ctrl_c
from .tools import report
from .units import parse_size


def _errors_to_exit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ShardkitError (and a few OS errors) into a one-line message and exit code 1; Ctrl-C
    into 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ShardkitError as e:
            raise click.ClickException(report.message(e)) from None
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "torch":
                raise
            raise click.ClickException(
                "this command reads through PyTorch, which is not installed: pip install torch"
            ) from None
        except KeyboardInterrupt:  # Ctrl-C: the shell's code for SIGINT, not bad input's 1
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # `shardkit info URL | head`: the reader left early; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second one at exit's flush
            sys.exit(141)  # a shell's code for a command ended by SIGPIPE
        except OSError as e:  # FileExistsError, NotADirectoryError, ...: the path and the reason
            text = f"{shown_name(str(e.filename))}: {e.strerror or e}" if e.filename is not None else one_line(e)
            raise click.ClickException(redact(text)) from None

    return wrapper


def _output(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A file to write at the end: its folder must exist before the work starts."""
    if value is not None and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
        raise click.BadParameter(f"{value}: no such folder to write it in")
    return value


def _plot_output(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--plot's file: its folder must exist and matplotlib must import, before the work starts."""
    if value is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.BadParameter("needs matplotlib: pip install matplotlib") from None
    return _output(ctx, param, value)


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):  # FloatRange lets nan through (and --json writes NaN)
        raise click.BadParameter(f"a number of milliseconds, not {value}")
    return value


def _examples(*lines: str) -> str:
    """An epilog of example command lines, kept as written (click's \\b)."""
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


def _storage_options(pairs: tuple[str, ...]) -> dict[str, Any] | None:
    """-o key=value pairs; values are JSON when they parse (numbers, true, {...}), else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected key=value, got {pair!r}", param_hint="-o")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out or None


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        size = parse_size(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if size < 1:
        raise click.BadParameter(f"must be at least 1 byte, not {value!r}")
    return size


class _OnError(click.Choice):  # type: ignore[type-arg]  # generic from click 8.2 on, not in 8.1
    """--on-error raise|skip, the words of on_error= in Python; pack's old "fail" is still taken,
    as raise, with a warning on stderr."""

    def __init__(self) -> None:
        super().__init__(ON_ERROR)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "fail":
            click.echo("Warning: --on-error fail is deprecated: use --on-error raise", err=True)
            return "raise"
        return super().convert(value, param, ctx)


storage_option = click.option(
    "-o",
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec storage option, repeatable (e.g. -o endpoint_url=http://127.0.0.1:9000); shardkit's own: "
    "-o timeout=SECONDS (silence before a request is retried, default 20), -o attempts=N.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(None, "-V", "--version", package_name="shardkit")
def main() -> None:
    """Pack image folders into WebDataset-compatible shards and inspect them."""


@main.command(
    epilog=_examples(
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
    callback=_size,
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
    type=_OnError(),
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
    callback=_size,
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
@_errors_to_exit
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
    from .packing.pack import pack as run_pack
    from .packing.sinks import sink_for
    from .storage import join

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
            storage_options=_storage_options(storage_options),
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


@main.command(
    epilog=_examples(
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
@_errors_to_exit
def info(url: str, as_json: bool, verbose: bool, storage_options: tuple[str, ...]) -> None:
    """Summarise the dataset at URL from its index.json."""
    from . import index
    from .storage import display

    opts = _storage_options(storage_options)
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
    from .storage import join
    from .storage.stores import store_for

    first = join(url, "") + idx.shards[0].name if formats.get(idx.kind).sharded and idx.shards else url
    for line in report.store_lines(store_for(first, storage_options).describe(first)):
        click.echo(line)


@main.command(
    epilog=_examples("shardkit verify ./photos-shards", "shardkit verify ./photos-shards --decode --workers 4")
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
@_errors_to_exit
def verify(url: str, quiet: bool, decode: bool, workers: int | None, storage_options: tuple[str, ...]) -> None:
    """Re-read every shard and check size, sha256, sample count and offsets against the index.

    For an LMDB: every sample of the index present with its recorded byte count, and no
    stray records. Exits 1 naming every bad shard. With --decode, every image is then
    decoded too (damaged pixel data between intact ends passes the checks above), and
    each one that does not decode is named by shard, sample and field.
    """
    from .formats.lmdb import DATA_FILE as LMDB_DATA_FILE
    from .storage import display
    from .tools.verify import undecodable
    from .tools.verify import verify as run_verify

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

    problems = run_verify(url, _storage_options(storage_options), on_shard=on_shard)
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
        bad = undecodable(url, _storage_options(storage_options), workers)
        for p in bad:
            click.echo(f"BAD  {p}", err=True)
        if bad:
            raise click.ClickException(report.undecodable_failure(len(bad), display(url)))
        if not quiet:
            click.echo("every image decodes")


@main.command(
    "index", epilog=_examples("shardkit index ./webdataset-shards", "shardkit index s3://bucket/photos --versions")
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
@_errors_to_exit
def index_cmd(url: str, force: bool, upgrade: bool, versions: bool, storage_options: tuple[str, ...]) -> None:
    """Write index.json for tar shards (.tar, .tar.gz, .tgz) made by another tool (webdataset,
    plain tar), with each remote shard's version, which readers check to catch a shard
    replaced under its name."""
    from dataclasses import replace

    from . import index, storage
    from .index.resolve import build_index, shard_urls

    opts = _storage_options(storage_options)
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
    from . import index

    idx = index.load(url, opts)
    already = report.nothing_to_upgrade(idx, index.INDEX_NAME)
    if already is not None:
        click.echo(already)
        return
    saved = index.save(idx, url, opts)
    assert saved.offsets_file is not None
    click.echo(report.upgraded(idx, saved, index.INDEX_NAME, index.VERSION))


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    """'0,1,2' -> [0, 1, 2]."""
    if value is None:
        return None
    try:
        values = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not values or min(values) < 0:
        raise click.BadParameter(f"expected comma-separated integers >= 0, got {value!r}")
    return values


def _transform(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """Import --transform now, so a wrong name is a usage error before anything starts."""
    if value is None:
        return None
    from .tools.bench import Transform

    try:
        return Transform(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


read_error_option = click.option(
    "--on-error",
    type=_OnError(),
    default="raise",
    show_default=True,
    help="On a bad sample (undecodable image, truncated shard): stop with an error naming it, "
    "or leave it out and count it.",
)

transform_option = click.option(
    "--transform",
    metavar="MODULE:FUNCTION",
    callback=_transform,
    help="Function applied to each decoded sample dict, from an importable module or a file (path/to/file.py:fn).",
)


@main.command(
    epilog=_examples(
        "shardkit bench ./photos-shards                           # ~90 s on 2 cores",
        "shardkit bench ./photos-shards --batches 10 --passes 1   # a quick look",
        "shardkit bench ./photos-shards --workers 4 --prefetch 2,8,32 --plot prefetch.png",
    )
)
@click.argument("url")
@click.option(
    "--workers",
    callback=_int_list,
    metavar="N[,N...]",
    help="DataLoader num_workers to try.  [default: 0,1,2; 2 when --prefetch is a list]",
)
@click.option(
    "--prefetch",
    callback=_int_list,
    metavar="N[,N...]",
    help="StreamingDataset prefetch depth(s) to try.  [default: 8]",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True, help="Samples per batch.")
@click.option(
    "--decode",
    type=click.Choice(["raw", "pil", "rgb8", "tensor"]),
    default="tensor",
    show_default=True,
    help="How images are decoded (raw: read speed only, the default transform skips decoding).",
)
@click.option("--batches", type=click.IntRange(min=1), default=50, show_default=True, help="Batches per timed pass.")
@click.option(
    "--passes",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Timed passes per setting (mean ± std over them).",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Batches before timing; the first one gives the time to first batch.",
)
@transform_option
@click.option(
    "--step-ms",
    type=click.FloatRange(min=0, min_open=True),
    metavar="T",
    callback=_finite,
    help="Say, per setting, whether a training step of T ms per batch would wait for data.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, writable=True),
    metavar="OUT.png",
    callback=_plot_output,
    help="Write images/s (error bars: std over passes) against the varied setting (needs matplotlib).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of a table.")
@read_error_option
@storage_option
@_errors_to_exit
def bench(
    url: str,
    workers: list[int] | None,
    prefetch: list[int] | None,
    batch_size: int,
    decode: str,
    batches: int,
    passes: int,
    warmup: int,
    transform: Any,
    step_ms: float | None,
    plot: str | None,
    as_json: bool,
    on_error: str,
    storage_options: tuple[str, ...],
) -> None:
    """Measure how fast URL streams through a DataLoader, for several num_workers (or prefetch depths).

    Per setting: a warm-up, then timed passes; images/s and MB/s (mean ± std over passes),
    time to the first batch (building the dataset included), peak memory (RSS of the main
    process plus its workers, Linux only; pages they share count in each, so an upper bound).
    Ends with the smallest setting within 5% of the fastest. The default run (3 settings x 3
    passes of 50 batches) takes about 90 s on 2 cores. At most one of --workers and --prefetch may
    be a list. Without --transform each sample becomes (its first image resized to 224x224,
    cls) so batches collate; a heavy transform of your own shifts the answer.
    """
    if workers is not None and prefetch is not None and len(workers) > 1 and len(prefetch) > 1:
        raise click.UsageError("vary one setting at a time: --workers or --prefetch may be a list, not both")
    if workers is None:
        workers = [2] if prefetch is not None and len(prefetch) > 1 else [0, 1, 2]
    from .tools.bench import format_report, run_bench, write_plot

    def progress(setting: dict[str, Any]) -> None:
        click.echo(report.bench_progress(setting), err=True)

    try:
        doc = run_bench(
            url,
            workers=workers,
            prefetch=prefetch or [8],
            batch_size=batch_size,
            decode=decode,
            transform=transform,
            batches=batches,
            passes=passes,
            warmup=warmup,
            step_ms=step_ms,
            storage_options=_storage_options(storage_options),
            on_error=on_error,
            progress=progress,
        )
    except (ValueError, TypeError) as e:  # results that do not batch (images of several sizes), a bad sample
        raise click.ClickException(report.in_cli_words(report.message(e))) from None
    click.echo(json.dumps(doc, indent=2) if as_json else format_report(doc))  # before the plot: a failed
    if plot:  # write costs no result
        write_plot(doc, plot)


@main.command(epilog=_examples("shardkit preview ./photos-shards --n 16 --out batch.png"))
@click.argument("url")
@click.option("--n", "n", type=click.IntRange(min=1), default=16, show_default=True, help="Samples to show.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    default="batch.png",
    show_default=True,
    callback=_output,
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
@_errors_to_exit
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
    from .tools.preview import render_preview

    try:
        result = render_preview(
            url,
            n=n,
            out=out,
            transform=transform,
            decode=decode,
            seed=seed,
            tile=tile,
            storage_options=_storage_options(storage_options),
            on_error=on_error,
        )
    except CorruptShardError as e:
        raise click.ClickException(report.in_cli_words(report.message(e))) from None
    click.echo(report.preview_written(out, result))


def run(*args: Any, **kwargs: Any) -> Any:
    """The `shardkit` command (its script and `python -m shardkit`): `main` with a second
    Ctrl-C that exits at once. `main` itself, called in a user's process (a notebook, a test's
    CliRunner), leaves that process's Ctrl-C alone."""
    exit_on_second_ctrl_c()
    return main(*args, **kwargs)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
