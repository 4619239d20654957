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
them into samples. What a layout delivered, and what it left for a resume, is progress.py's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
        if windowed(layout):
            a = blockplan.window_bounds(at, layout.window)[0]
            b = min(n, blockplan.window_bounds(min(n, a + chunk) - 1, layout.window)[1])
            stream = blockplan.window_order(window_key(layout, rank, worker_id), a, b, layout.window)[at - a :]
        else:
            b = min(n, at + chunk)
            stream = np.arange(at, b, dtype=np.int64)
        yield (first + stream) % total
        at = b


def windowed(layout: Layout) -> bool:
    """Whether a worker's stream under `layout` is shuffled in windows."""
    return layout.shuffle and layout.window > 1


def window_key(layout: Layout, rank: int, worker_id: int) -> np.uint64:
    """The key that shuffles the windows of one worker's stream."""
    k: np.uint64 = blockplan.key(
        layout.seed, layout.epoch, layout.segment, rank, worker_id, layout.world_size, layout.num_workers
    )[0]
    return k


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
