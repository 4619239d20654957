"""shardkit.bench.harness: the rounds, medians, ranges and tables every benchmark prints."""

from __future__ import annotations

from shardkit.bench.harness import (
    aligned,
    error_bars,
    interleaved,
    markdown_table,
    mean_std,
    median,
    ratio_spread,
    rotate,
    spread,
)


def test_rounds_turn_the_order_so_none_always_runs_first() -> None:
    assert rotate(["a", "b", "c"], 4) == ["b", "c", "a"] and rotate([], 3) == []
    assert list(interleaved(["a", "b"], 3)) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


def test_medians_with_their_ranges() -> None:
    assert median(x for x in (3, 1, 2)) == 2
    assert spread([1210.4, 1187.0, 1302.9]) == "1,210 (1,187-1,303)"
    assert spread([12e6, 13e6], scale=1e-6) == "12 (12-13)"
    assert spread([0.412], digits=2) == "0.41" and spread([0.412], digits=2, range_of_one=True) == "0.41 (0.41-0.41)"
    assert spread([]) == "-"


def test_ratios_are_taken_round_by_round() -> None:
    assert ratio_spread([90, 80, 200], [100, 100, 200]) == "90% (80%-100%)"
    assert ratio_spread([2.5, 3.0], [2.0, 2.0], ".2f", "x") == "1.38x (1.25-1.50)"
    assert ratio_spread([], []) == "–"


def test_tables_and_chart_whiskers() -> None:
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"
    assert aligned([("n", "rate"), ("10", "5")]) == [" n  rate", "10     5"]
    assert error_bars([[1.0, 2.0, 4.0]]) == ([2.0], [[1.0], [2.0]])
    assert mean_std([2.0]) == (2.0, 0.0)
