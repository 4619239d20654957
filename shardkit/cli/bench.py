"""`shardkit bench`: how fast a dataset streams through a DataLoader, for several settings."""

from __future__ import annotations

import json
import math
from typing import Any

import click

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


def _plot_output(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--plot's file: its folder must exist and matplotlib must import, before the work starts."""
    if value is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.BadParameter("needs matplotlib: pip install matplotlib") from None
    return output_file(ctx, param, value)


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):  # FloatRange lets nan through (and --json writes NaN)
        raise click.BadParameter(f"a number of milliseconds, not {value}")
    return value


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


@click.command(
    epilog=examples(
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
@errors_to_exit
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
    from ..bench.loader import run_bench
    from ..bench.report import format_report, write_plot

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
            storage_options=parse_storage_options(storage_options),
            on_error=on_error,
            progress=progress,
        )
    except (ValueError, TypeError) as e:  # results that do not batch (images of several sizes), a bad sample
        raise click.ClickException(report.in_cli_words(report.message(e))) from None
    click.echo(json.dumps(doc, indent=2) if as_json else format_report(doc))  # before the plot: a failed
    if plot:  # write costs no result
        write_plot(doc, plot)
