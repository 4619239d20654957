"""Who reads which sample, in which order: plain arithmetic on sample counts.

An epoch's order is a pure function of (seed, epoch, shard sample counts) and the layout
(world size W, workers per rank N). Every worker computes its own part, in time and memory
proportional to that part; nothing is shared or negotiated between processes.

1. Global sequence: samples are grouped in blocks of `block` consecutive samples of one
   shard; with shuffle the blocks are permuted by (seed, epoch) (blockplan.BlockOrder, which
   finds the samples at any positions without building the sequence). Blocks keep reads
   sequential inside a shard while neighbouring blocks come from unrelated shards.
2. Ranks: the sequence is padded by repeating its start ("repeat", the default: every
   sample is seen, a few twice) or truncated ("drop") to W * R samples, and rank r takes
   the r-th run of R. Every rank gets exactly R samples, so DDP never waits on a rank.
3. Workers: a rank's run is cut into N contiguous parts whose sizes depend only on (R, N),
   so every rank has the same per-worker sizes and hence the same number of batches. When
   the dataset batches (B samples a batch), the parts are whole batches: ceil(R / B) per
   rank whatever N, only the last one short.
4. Within a worker, with shuffle, each window of `window` samples is permuted. The first
   windows are smaller (`window / 8`, doubling up to `window`): the first batch then needs
   the bytes of two or three blocks, not of every block a whole window spans (1024
   ImageNet-sized samples are ~100 MB, which a remote first batch would otherwise wait for).

Everything here works on positions in the sequence (`worker_positions`); the dataset turns
them into samples. Resume: a worker's stream is known in advance, so "k samples yielded"
identifies exactly which positions it delivered. A checkpoint records the layout and each
worker's count (`Progress`); the positions not yet delivered form the sequence of a new
segment that any layout can split again (elastic resume). `Segments` keeps them as spans
of positions, so a re-plan costs O(W * N * window), not O(samples).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import blockplan
from .. import checks

REMAINDERS = ("repeat", "drop")
CHUNK = 1 << 16  # positions of a worker's stream planned at a time (~6 MB of plan at ~88 B a position)


def world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): explicit arguments, else torch.distributed when initialised,
    else the RANK / WORLD_SIZE environment variables, else (0, 1)."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError("pass both rank and world_size, or neither")
        rank, world_size = checks.integer("rank", rank), checks.integer("world_size", world_size, 1)
    else:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = _environ("RANK", 0), _environ("WORLD_SIZE", 1)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    return rank, world_size


def _environ(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the environment variable {name}={text!r} is not an integer") from None


def worker() -> tuple[int, int]:
    """(worker id, number of workers) of the current DataLoader worker; (0, 1) in the main process."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def epoch_order(
    counts: Sequence[int] | np.ndarray, *, seed: int, epoch: int, shuffle: bool, block: int | np.ndarray
) -> blockplan.BlockOrder:
    """The global sequence of an epoch over shards of `counts` samples (sample ids 0..T-1,
    shard by shard), as a lookup by position. `block` is one size for every shard, or each
    shard's (a compressed shard's block is all of it)."""
    keys = blockplan.key(seed, epoch, 0x5EED, n=blockplan.ROUNDS) if shuffle else None
    return blockplan.BlockOrder(np.asarray(counts, dtype=np.int64), block, keys)


def per_rank(total: int, world_size: int, remainder: str) -> int:
    """Samples every rank yields in an epoch of `total` samples."""
    if remainder not in REMAINDERS:
        raise ValueError(f"remainder must be one of {REMAINDERS}, not {remainder!r}")
    if total == 0:
        return 0
    return -(-total // world_size) if remainder == "repeat" else total // world_size


def worker_bounds(rank_total: int, num_workers: int, worker_id: int, batch: int = 1) -> tuple[int, int]:
    """[start, stop) of a worker's part of its rank's run. The run is cut into whole batches
    of `batch` samples (the last one may be short) and workers get numbers of batches that
    differ by at most one, so the rank yields ceil(rank_total / batch) batches whatever N."""
    chunks = -(-rank_total // batch)
    base, extra = divmod(chunks, num_workers)
    start = worker_id * base + min(worker_id, extra)
    stop = start + base + (worker_id < extra)
    return min(start * batch, rank_total), min(stop * batch, rank_total)


@dataclass(frozen=True)
class Layout:
    """Everything besides (rank, worker) that shapes a worker's stream."""

    world_size: int
    num_workers: int
    seed: int
    epoch: int
    shuffle: bool
    window: int
    remainder: str
    segment: int = 0  # 0 for a fresh epoch; n after n elastic resumes inside it
    batch: int = 1  # samples per batch when the dataset batches (workers split whole batches)


def worker_positions(total: int, layout: Layout, rank: int, worker_id: int) -> np.ndarray:
    """The positions (in a sequence of `total`) that worker `worker_id` of rank `rank`
    yields, in order (all of `worker_chunks`, for tests and small datasets)."""
    return np.concatenate([np.empty(0, dtype=np.int64), *worker_chunks(total, layout, rank, worker_id)])


def worker_chunks(
    total: int, layout: Layout, rank: int, worker_id: int, skip: int = 0, chunk: int = CHUNK
) -> Iterator[np.ndarray]:
    """`worker_positions` from its `skip`-th on, made a piece of about `chunk` positions at a
    time, as they are needed: a pass's memory and start follow the piece, not the epoch.
    Pieces end on shuffle windows, each window being permuted on its own."""
    r = per_rank(total, layout.world_size, layout.remainder)
    lo, hi = worker_bounds(r, layout.num_workers, worker_id, layout.batch)
    n, first = hi - lo, rank * r + lo
    at = skip
    while at < n:
        if _windowed(layout):
            a = blockplan.window_bounds(at, layout.window)[0]
            b = min(n, blockplan.window_bounds(min(n, a + chunk) - 1, layout.window)[1])
            stream = blockplan.window_order(_window_key(layout, rank, worker_id), a, b, layout.window)[at - a :]
        else:
            b = min(n, at + chunk)
            stream = np.arange(at, b, dtype=np.int64)
        yield (first + stream) % total
        at = b


def _windowed(layout: Layout) -> bool:
    return layout.shuffle and layout.window > 1


def _window_key(layout: Layout, rank: int, worker_id: int) -> np.uint64:
    k: np.uint64 = blockplan.key(
        layout.seed, layout.epoch, layout.segment, rank, worker_id, layout.world_size, layout.num_workers
    )[0]
    return k


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
        whole, end = blockplan.window_bounds(k, layout.window) if _windowed(layout) else (k, k)
        first = ranks * r + lo  # each rank's first position of w
        starts.append(first)
        stops.append(first + whole)
        if k > whole:  # the partial window: its first k - whole positions in shuffled order
            end = min(end, hi - lo)
            for i, one in enumerate(ranks.tolist()):
                part = blockplan.window_order(_window_key(layout, one, w), whole, end, layout.window)[: k - whole]
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


def mix_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """Samples each dataset contributes to an epoch of `total`: proportional to `weights`,
    whole numbers by largest remainder, summing to `total` exactly."""
    w = np.asarray(weights, dtype=np.float64)
    if len(w) == 0 or (w <= 0).any() or not np.isfinite(w).all():
        raise ValueError("weights must be positive numbers")
    with np.errstate(over="ignore"):
        if not np.isfinite(w.sum()):  # huge weights: scaled, only then (rounding ties must not move)
            w = w / w.max()
    share = w / w.sum() * total
    counts: np.ndarray = np.floor(share).astype(np.int64)
    order = np.argsort(-(share - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return counts


def mix_order(counts: Sequence[int] | np.ndarray, *, seed: int, epoch: int, shuffle: bool) -> blockplan.Interleave:
    """Which dataset each position of a mixed epoch draws from: each dataset exactly
    counts[d] times, its j-th draw at a random point of the j-th 1/counts[d] of the epoch
    (shuffle) or at its middle (evenly spread)."""
    keys = blockplan.key(seed, epoch, 0x313) if shuffle else None
    return blockplan.Interleave(np.asarray(counts, dtype=np.int64), keys)
