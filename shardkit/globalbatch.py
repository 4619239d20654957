"""Global batches: an epoch as a sequence of batches of B samples that is the same whatever
the world size W and number of DataLoader workers N (`StreamingDataset(global_batch_size=B)`).

The epoch's global sequence (partition.epoch_order: blocks of a shard's consecutive samples
in permuted order) is cut into slots: `batches` global batches of B slots, the sequence
padded by its start ("repeat") or cut short ("drop") to a whole number of them. With
shuffle, slots are grouped in windows of whole batches (about `shuffle_window` slots) and
each window's positions are cut into pieces of `piece` consecutive positions (half a block
by default), which the window permutes: a global batch then holds runs of `piece` samples
from several blocks, and each block's pieces land in different batches of its window.

Rank r takes slots [r * B / W, (r + 1) * B / W) of every global batch; the DataLoader of a
rank takes batch j of its N workers from worker j % N, so worker w yields the rank's
batches j = w, w + N, ... A rank reads its slice of a batch as a few runs of consecutive
samples, never the rest of a block: an epoch reads the dataset's bytes once, in about one
request a piece. Nothing is shared between processes: each worker computes its slots.

Resume is arithmetic: ranks step in lockstep, so progress is a number of global batches K,
found from any rank's worker counts, and any layout continues at batch K.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from . import blockplan

CHUNK = 1 << 16  # slots of a worker planned at a time
MAX_BATCHES = 4096  # local batches planned at a time (each may touch two windows' tables)


def local_size(batch: int, world: int) -> int:
    """B / W: samples of each rank's slice of a global batch, or a ValueError naming what works."""
    if world < 1 or batch % world:
        works = [w for w in range(1, min(batch, 4096) + 1) if batch % w == 0]
        shown = ", ".join(map(str, works[:12])) + (", ..." if len(works) > 12 else "")
        raise ValueError(f"global_batch_size={batch} does not split evenly over world size {world}: use a world size "
                         f"that divides it ({shown}) or a global batch size that is a multiple of {world}")
    return batch // world


@dataclass(frozen=True, eq=False)
class GlobalBatches:
    """The slots of an epoch of `total` positions: `positions(slots)` says which position
    of the global sequence each slot holds."""

    total: int
    size: int  # B
    remainder: str
    window: int  # slots a window: a whole number of batches
    piece: int
    key: np.uint64 | None  # None: no shuffle, slot s holds position s

    @property
    def batches(self) -> int:
        return -(-self.total // self.size) if self.remainder == "repeat" else self.total // self.size

    @property
    def slots(self) -> int:
        return self.batches * self.size

    def positions(self, slots: np.ndarray) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64)
        if self.total == 0:
            return slots
        if self.key is None:
            out: np.ndarray = slots % self.total
            return out
        win, offset = np.divmod(slots, self.window)
        full = np.minimum(self.window, self.slots - win * self.window) // self.piece  # whole pieces of each window
        q, within = np.divmod(offset, self.piece)
        moved = q < full  # a window's short last piece stays where it is
        p = slots.copy()
        p[moved] = win[moved] * self.window + self._permuted(win[moved], q[moved], full[moved]) * self.piece \
            + within[moved]
        out = p % self.total
        return out

    def _permuted(self, win: np.ndarray, q: np.ndarray, n: np.ndarray) -> np.ndarray:
        """Where window `win`'s permutation of its `n` pieces sends piece q: for each window,
        its pieces sorted by hashes keyed by (window, piece)."""
        out = np.empty(len(q), dtype=np.int64)
        for size in np.unique(n).tolist():  # the last window of an epoch may be shorter
            sel = np.flatnonzero(n == size)
            windows, row = np.unique(win[sel], return_inverse=True)
            hashes = blockplan.hashed(self.key, windows[:, None] * size + np.arange(size)[None, :])  # type: ignore[arg-type]
            table = np.argsort(hashes, axis=1, kind="stable")
            out[sel] = table[row, q[sel]]
        return out


def plan(total: int, size: int, *, remainder: str, shuffle: bool, window: int, piece: int, seed: int,
         epoch: int) -> GlobalBatches:
    """The global batches of an epoch: a pure function of these values, W and N aside."""
    key = blockplan.key(seed, epoch, 0x6B47, n=1)[0] if shuffle else None
    return GlobalBatches(total, size, remainder, max(1, window // size) * size, max(1, piece), key)


def worker_batches(batches: int, num_workers: int, worker_id: int) -> int:
    """Batches j < `batches` with j % num_workers == worker_id: a worker's share of a pass."""
    return max(0, -(-(batches - worker_id) // num_workers))


def worker_chunks(gb: GlobalBatches, start: int, world: int, rank: int, num_workers: int, worker_id: int,
                  skip: int = 0, chunk: int = CHUNK) -> Iterator[np.ndarray]:
    """The positions worker `worker_id` of rank `rank` yields in a pass that begins at global
    batch `start`, from its `skip`-th on, a piece at a time: its rank's slice of global
    batches start + w, start + w + N, ..."""
    for slots in worker_slots(gb, start, world, rank, num_workers, worker_id, skip, chunk):
        yield gb.positions(slots)


def worker_slots(gb: GlobalBatches, start: int, world: int, rank: int, num_workers: int, worker_id: int,
                 skip: int = 0, chunk: int = CHUNK) -> Iterator[np.ndarray]:
    """The slots behind `worker_chunks`' positions."""
    b = local_size(gb.size, world)
    mine = worker_batches(gb.batches - start, num_workers, worker_id)
    per = max(1, min(chunk // b, MAX_BATCHES))
    first, cut = divmod(skip, b)
    for i in range(first, mine, per):
        spans = slot_spans(gb.size, start, b, rank, num_workers, worker_id, i, min(mine, i + per))
        yield (spans[:, None] + np.arange(b)[None, :]).ravel()[cut if i == first else 0 :]


def slot_spans(size: int, start: int, b: int, rank: int, num_workers: int, worker_id: int, lo: int,
               hi: int) -> np.ndarray:
    """The first slot of the worker's local batches lo..hi-1 (each b slots long)."""
    j = np.arange(lo, hi, dtype=np.int64) * num_workers + worker_id
    out: np.ndarray = (start + j) * size + rank * b
    return out


def batches_done(num_workers: int, yielded: Sequence[int], b: int) -> int:
    """The global batches a pass delivered, from its workers' sample counts (rank slices of
    b samples, handed out in turn): a ValueError if no such pass gives these counts."""
    done = sum(yielded) // b
    expected = [b * worker_batches(done, num_workers, w) for w in range(num_workers)]
    if list(yielded) != expected:
        raise ValueError(f"worker counts {list(yielded)} are not those of a loader that handed out {done} batches of "
                         f"{b} samples in turn from {num_workers} workers ({expected}): this state would resume other "
                         "batches than those left (saved with a DataLoader batch_size other than global_batch_size "
                         "/ world size, or edited)")
    return done
