"""Medians with min-max over a benchmark's rounds, written one way for the scripts in scripts/.

    from bench_stats import median, spread
    spread([1210.4, 1187.0, 1302.9])            # '1,210 (1,187-1,303)'
    spread([0.412, 0.398], digits=2)            # '0.41 (0.40-0.41)'
    spread([12e6, 13e6], scale=1e-6)            # '12 (12-13)'   (bytes as MB)

One value prints alone (no range to show); none prints "-".
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def spread(values: Iterable[float], digits: int = 0, scale: float = 1.0) -> str:
    """'median (min-max)' of `values` times `scale`, with thousands separators and `digits`
    decimals."""
    vals = [v * scale for v in values]
    if not vals:
        return "-"
    med = f"{statistics.median(vals):,.{digits}f}"
    lo, hi = f"{min(vals):,.{digits}f}", f"{max(vals):,.{digits}f}"
    return med if len(vals) == 1 else f"{med} ({lo}-{hi})"
