"""Who reads which sample, in which order: plain arithmetic on sample counts.

An epoch's order is a pure function of (seed, epoch, shard sample counts) and the layout
(world size W, workers per rank N). Every worker computes its own part; nothing is shared
or negotiated between processes.

1. Global sequence: samples are grouped in blocks of `block` consecutive samples of one
   shard; with shuffle the blocks are permuted by (seed, epoch). Blocks keep reads
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

Resume: a worker's stream is known in advance, so "k samples yielded" identifies exactly
which samples it delivered. A checkpoint records the layout and each worker's count
(`Progress`); the samples not yet delivered form the sequence of a new segment that any
layout can split again (elastic resume).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import checks

REMAINDERS = ("repeat", "drop")


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


def _rng(*key: int) -> np.random.Generator:
    """A generator for `key`: every bit of each part counts (seeds of any size), a negative
    part as its 64-bit two's complement."""
    return np.random.default_rng([k if k >= 0 else k & 0xFFFF_FFFF_FFFF_FFFF for k in key])


def global_sequence(counts: Sequence[int] | np.ndarray, *, seed: int, epoch: int, shuffle: bool,
                    block: int | np.ndarray) -> np.ndarray:
    """Global sample ids (0..T-1, shard by shard) in the epoch's order. `block` is one
    size for every shard, or each shard's (a compressed shard's block is all of it)."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if not shuffle or total == 0:
        return np.arange(total, dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    # blocks: (start id, length), `block` samples at a time within each shard
    nblocks = -(-counts // block)
    size = np.repeat(np.broadcast_to(np.asarray(block, dtype=np.int64), counts.shape), nblocks)
    starts = np.repeat(first, nblocks) + size * (np.arange(nblocks.sum()) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks))
    ends = np.minimum(starts + size, np.repeat(first + counts, nblocks))
    order = _rng(seed, epoch, 0x5EED).permutation(len(starts))
    starts, lengths = starts[order], (ends - starts)[order]
    # ids = start of own block + position inside it
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total, dtype=np.int64)


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


def worker_stream(sequence: np.ndarray, layout: Layout, rank: int, worker_id: int) -> np.ndarray:
    """The ids worker `worker_id` of rank `rank` yields, in order."""
    r = per_rank(len(sequence), layout.world_size, layout.remainder)
    lo, hi = worker_bounds(r, layout.num_workers, worker_id, layout.batch)
    positions = np.arange(rank * r + lo, rank * r + hi, dtype=np.int64)
    ids = sequence[positions % len(sequence)] if len(sequence) else positions
    if layout.shuffle and layout.window > 1 and len(ids) > 1:
        rng = _rng(layout.seed, layout.epoch, layout.segment, rank, worker_id, layout.world_size, layout.num_workers)
        start, size = 0, max(1, layout.window // 8)
        while start < len(ids):
            rng.shuffle(ids[start : start + size])
            start, size = start + size, min(layout.window, 2 * size)
    return ids


@dataclass(frozen=True)
class Progress:
    """How far a layout got through a segment: samples yielded by each worker, identical on
    every rank (DDP ranks step in lockstep, so a checkpoint of one rank describes all)."""

    world_size: int
    num_workers: int
    yielded: tuple[int, ...]
    batch: int = 1

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "num_workers": self.num_workers, "yielded": list(self.yielded),
                "batch": self.batch}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Progress:
        if not isinstance(d, dict):
            raise TypeError(f"a pass's progress is a dict, not {d!r}")
        p = cls(int(d["world_size"]), int(d["num_workers"]), tuple(int(k) for k in d["yielded"]), int(d.get("batch", 1)))
        if len(p.yielded) != p.num_workers:
            raise ValueError(f"progress lists {len(p.yielded)} worker counts for {p.num_workers} workers")
        if min(p.world_size, p.num_workers, p.batch) < 1 or min(p.yielded) < 0:
            raise ValueError(f"progress with world_size {p.world_size}, num_workers {p.num_workers}, batch {p.batch} "
                             f"and counts {list(p.yielded)} comes from no pass")
        return p


def remaining(sequence: np.ndarray, layout: Layout, progress: Progress) -> np.ndarray:
    """The samples of `sequence` that `progress` under `layout` has not yet delivered, in
    sequence order (ids already delivered are removed even where padding repeated them)."""
    seen = [
        worker_stream(sequence, layout, rank, w)[: progress.yielded[w]]
        for rank in range(layout.world_size)
        for w in range(layout.num_workers)
    ]
    done = np.concatenate(seen) if seen else np.empty(0, dtype=np.int64)
    return sequence[~np.isin(sequence, done)]


def pass_length(counts: Sequence[int], batch_size: int, drop_last: bool = False) -> int:
    """Samples a torch DataLoader hands out in a pass over workers holding `counts`."""
    return sum(c - c % batch_size if drop_last else c for c in counts)


def yielded_after(counts: Sequence[int], batch_size: int, samples_seen: int, drop_last: bool = False) -> tuple[int, ...]:
    """Per-worker samples a torch DataLoader has taken after it handed out `samples_seen`
    samples: batches come from workers in turn, an exhausted worker drops out of the turn.
    Raises ValueError for a count no such loader hands out: negative, past the pass, or
    not a whole number of its batches."""
    whole = pass_length(counts, batch_size, drop_last)
    if not 0 <= samples_seen <= whole:
        raise ValueError(f"samples_seen={samples_seen}: a pass of this loader hands out 0 to {whole} samples (per rank)")
    left = [c // batch_size if drop_last else -(-c // batch_size) for c in counts]
    taken = [0] * len(counts)
    seen = 0
    while seen < samples_seen and any(left):
        for w, c in enumerate(counts):
            if left[w] and seen < samples_seen:
                n = min(batch_size, c - taken[w])
                taken[w] += n
                seen += n
                left[w] -= 1
    if seen != samples_seen:
        raise ValueError(f"samples_seen={samples_seen} is not a whole number of batches of this loader: "
                         f"it hands out {seen - n} and then {seen}")
    return tuple(taken)


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


def mix_sources(counts: Sequence[int] | np.ndarray, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Which dataset each position of a mixed epoch draws from: each dataset exactly
    counts[d] times, interleaved at random (shuffle) or evenly spread."""
    counts = np.asarray(counts, dtype=np.int64)
    labels = np.repeat(np.arange(len(counts)), counts)
    if shuffle:
        return _rng(seed, epoch, 0x313).permutation(labels)
    # evenly spread: dataset d's i-th draw sits at (i + 0.5) / counts[d] of the epoch
    within = np.arange(len(labels)) - np.repeat(np.cumsum(counts) - counts, counts)
    return labels[np.argsort((within + 0.5) / np.repeat(counts, counts), kind="stable")]
