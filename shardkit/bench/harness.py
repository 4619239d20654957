"""The benchmark harness: rounds with the contestants interleaved, medians with their ranges,
ratio cells and markdown tables, written one way for `shardkit bench` and for the project's
benchmarks (the top-level ``bench/`` folder of the repository).

A machine's speed drifts (a shared 2-core machine by a third between rounds), so contestants
take turns round after round, the order turned each round (`interleaved`), and a ratio to a
limit is taken round by round, the limit measured in the same round (`ratio_spread`)::

    for r, name in interleaved(["cat (limit)", "shardkit raw"], rounds=3):
        results.setdefault(name, []).append(measure(name))
    spread([1210.4, 1187.0, 1302.9])            # '1,210 (1,187-1,303)'
    spread([12e6, 13e6], scale=1e-6)            # '12 (12-13)'   (bytes as MB)
    ratio_spread([90, 80], [100, 100])          # '85% (80%-90%)'
    markdown_table(["loader", "images/s"], [["shardkit", "1,210"]])
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def median(values: Iterable[float]) -> float:
    """The median of `values` (any iterable, a generator too)."""
    return statistics.median(list(values))


def rotate(items: Sequence[T], r: int) -> list[T]:
    """Round r's order: `items` turned by r places, so that none always runs first or last."""
    k = r % max(len(items), 1)
    return [*items[k:], *items[:k]]


def interleaved(contestants: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, contestant) for `rounds` rounds of every contestant, the order turning each round."""
    for r in range(rounds):
        for contestant in rotate(contestants, r):
            yield r, contestant


def spread(values: Iterable[float], digits: int = 0, scale: float = 1.0, *, range_of_one: bool = False) -> str:
    """'median (min-max)' of `values` times `scale`, with thousands separators and `digits`
    decimals. One value prints alone (no range to show) unless `range_of_one`; none prints "-"."""
    vals = [v * scale for v in values]
    if not vals:
        return "-"
    med = f"{statistics.median(vals):,.{digits}f}"
    lo, hi = f"{min(vals):,.{digits}f}", f"{max(vals):,.{digits}f}"
    return med if len(vals) == 1 and not range_of_one else f"{med} ({lo}-{hi})"


def ratios(values: Iterable[float], limits: Iterable[float]) -> list[float]:
    """Round by round: each value over the limit measured in the same round."""
    return [v / x for v, x in zip(values, limits)]


def ratio_spread(
    values: Iterable[float], limits: Iterable[float], spec: str = ".0%", suffix: str = "", empty: str = "–"
) -> str:
    """'median (min-max)' over rounds of value / limit, each number formatted with `spec` and
    `suffix` (".0%": '85% (80%-90%)'; ".2f", "x": '1.23x (1.10-1.31)'); `empty` without rounds."""
    rs = ratios(values, limits)
    if not rs:
        return empty
    return f"{statistics.median(rs):{spec}}{suffix} ({min(rs):{spec}}-{max(rs):{spec}})"


def markdown_table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table: the head, its rule, a line a row (cells as given, str() of each)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def error_bars(series: Sequence[Sequence[float]]) -> tuple[list[float], list[list[float]]]:
    """(medians, [below, above]) of each series of rounds: a chart's bars and their min-max
    whiskers, as matplotlib's ``yerr=``/``xerr=`` take them."""
    meds = [statistics.median(s) for s in series]
    return meds, [[m - min(s) for m, s in zip(meds, series)], [max(s) - m for m, s in zip(meds, series)]]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation) of `values`; the deviation of one value is 0."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """A plain-text table for a terminal: a line a row, every column right-justified to its
    widest cell, two spaces between columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]


def agg_figure(figsize: tuple[float, float], dpi: float = 100) -> Any:
    """A matplotlib Figure drawn by Agg, without pyplot's global state (nothing to close);
    ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi)
    FigureCanvasAgg(fig)
    return fig
