"""How far a layout got through an epoch, and what it left: resume's arithmetic on positions.

A worker's stream is known in advance (partition.py), so "k samples yielded" identifies
exactly which positions it delivered. A checkpoint records the layout and each worker's
count (`Progress`); the positions not yet delivered form the sequence of a new segment that
any layout can split again (elastic resume). `Segments` keeps them as spans of positions,
so a re-plan costs O(W * N * window), not O(samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import blockplan
from .partition import Layout, per_rank, window_key, windowed, worker_bounds


@dataclass(frozen=True)
class Progress:
    """How far a layout got through a segment: samples yielded by each worker, identical on
    every rank (DDP ranks step in lockstep, so a checkpoint of one rank describes all)."""

    world_size: int
    num_workers: int
    yielded: tuple[int, ...]
    batch: int = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "yielded": list(self.yielded),
            "batch": self.batch,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Progress:
        if not isinstance(d, dict):
            raise TypeError(f"a pass's progress is a dict, not {d!r}")
        p = cls(
            int(d["world_size"]), int(d["num_workers"]), tuple(int(k) for k in d["yielded"]), int(d.get("batch", 1))
        )
        if len(p.yielded) != p.num_workers:
            raise ValueError(f"progress lists {len(p.yielded)} worker counts for {p.num_workers} workers")
        if min(p.world_size, p.num_workers, p.batch) < 1 or min(p.yielded) < 0:
            raise ValueError(
                f"progress with world_size {p.world_size}, num_workers {p.num_workers}, batch {p.batch} "
                f"and counts {list(p.yielded)} comes from no pass"
            )
        return p


def remaining(total: int, layout: Layout, progress: Progress) -> np.ndarray:
    """The positions of a sequence of `total` that `progress` under `layout` has not yet
    delivered, as spans [start, stop) in order (rows of an (n, 2) array); positions that
    padding repeated count as delivered wherever they sit."""
    if total == 0:
        return np.empty((0, 2), dtype=np.int64)
    return _complement(*delivered(total, layout, progress), total)


def delivered(
    total: int, layout: Layout, progress: Progress, rank: int | None = None, worker_id: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The positions of a sequence of `total` that `progress` under `layout` delivered (of
    one rank, or one worker, if given), as spans [starts, stops) that may run past `total`
    (padding: they wrap round to the sequence's start)."""
    r = per_rank(total, layout.world_size, layout.remainder)
    ranks = np.arange(layout.world_size, dtype=np.int64) if rank is None else np.array([rank], dtype=np.int64)
    starts, stops = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=np.int64)]
    for w, k in enumerate(progress.yielded):
        if worker_id is not None and w != worker_id:
            continue
        lo, hi = worker_bounds(r, layout.num_workers, w, layout.batch)
        k = min(k, hi - lo)
        whole, end = blockplan.window_bounds(k, layout.window) if windowed(layout) else (k, k)
        first = ranks * r + lo  # each rank's first position of w
        starts.append(first)
        stops.append(first + whole)
        if k > whole:  # the partial window: its first k - whole positions in shuffled order
            end = min(end, hi - lo)
            for i, one in enumerate(ranks.tolist()):
                part = blockplan.window_order(window_key(layout, one, w), whole, end, layout.window)[: k - whole]
                starts.append(first[i] + part)
                stops.append(first[i] + part + 1)
    return np.concatenate(starts), np.concatenate(stops)


def wrapped(starts: np.ndarray, stops: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Spans of `delivered` inside [0, total): one running past it split in two (no span is
    longer than `total`)."""
    lengths = stops - starts
    starts = starts[lengths > 0] % total
    ends = starts + lengths[lengths > 0]
    over = ends[ends > total] - total
    return (
        np.concatenate([starts, np.zeros(len(over), dtype=np.int64)]),
        np.concatenate([np.minimum(ends, total), over]),
    )


def _complement(starts: np.ndarray, stops: np.ndarray, total: int) -> np.ndarray:
    """The spans of [0, total) outside the spans [starts, stops). A span may start past
    `total` or run over it (padding repeats the sequence's start): it wraps around, at
    most once since none is longer than `total`."""
    starts, ends = wrapped(starts, stops, total)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    covered = np.concatenate([[0], np.maximum.accumulate(ends)]) if len(ends) else np.zeros(1, dtype=np.int64)
    gap = starts > covered[:-1]  # the positions between what came before and this span
    spans = [np.stack([covered[:-1][gap], starts[gap]], axis=1)]
    if covered[-1] < total:
        spans.append(np.array([[covered[-1], total]], dtype=np.int64))
    return np.concatenate(spans).astype(np.int64)


@dataclass(frozen=True)
class Segments:
    """What is left of an epoch of `total` positions after interrupted segments: for each
    segment, the spans of its own positions that it left (see `remaining`)."""

    total: int
    spans: tuple[np.ndarray, ...] = ()

    @property
    def left(self) -> int:
        """The length of the sequence the next segment splits."""
        return int(np.diff(self.spans[-1], axis=1).sum()) if self.spans else self.total

    def after(self, layout: Layout, progress: Progress) -> Segments:
        """These segments, then one under `layout` that got as far as `progress`."""
        return Segments(self.total, (*self.spans, remaining(self.left, layout, progress)))

    def base_spans(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Spans of the last segment's sequence as spans of the epoch's (each cut where the
        earlier segments' spans end)."""
        for spans in reversed(self.spans):
            lengths = spans[:, 1] - spans[:, 0]
            before = np.cumsum(lengths) - lengths
            first = np.searchsorted(before, starts, side="right") - 1
            last = np.searchsorted(before, stops - 1, side="right") - 1
            n = np.maximum(last - first + 1, 0)
            which = np.repeat(first, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            lo = np.maximum(np.repeat(starts, n), before[which])
            hi = np.minimum(np.repeat(stops, n), before[which] + lengths[which])
            starts, stops = spans[which, 0] + lo - before[which], spans[which, 0] + hi - before[which]
        return starts, stops

    def base(self, positions: np.ndarray) -> np.ndarray:
        """Positions in the last segment's sequence as positions in the epoch's."""
        for spans in reversed(self.spans):
            lengths = spans[:, 1] - spans[:, 0]
            before = np.cumsum(lengths) - lengths
            i = np.searchsorted(before, positions, side="right") - 1
            positions = spans[i, 0] + positions - before[i]
        return positions
