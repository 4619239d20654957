"""Global batches: an epoch as a sequence of batches of B samples that is the same whatever
the world size W and number of DataLoader workers N (`StreamingDataset(global_batch_size=B)`).

The epoch's global sequence (partition.epoch_order: blocks of a shard's consecutive samples
in permuted order) is cut into slots: `batches` global batches of B slots, the sequence
padded by its start ("repeat") or cut short ("drop") to a whole number of them. With
shuffle, slots are grouped in windows of whole batches (about `shuffle_window` slots) and
each window's positions are cut into pieces, the halves of its blocks (each a run of one
shard; a mixture's, runs of `piece` positions), which the window permutes, the pieces
shorter than `piece` (a shard's short last block, a block cut by the window's edge) at its
end, so that pieces start on multiples of `piece` as the ranks' slices do: a global batch
then holds runs of half a block from several blocks, and a block's two halves land in
different batches of its window.

Rank r takes slots [r * B / W, (r + 1) * B / W) of every global batch; the DataLoader of a
rank takes batch j of its N workers from worker j % N, so worker w yields the rank's
batches j = w, w + N, ... A rank reads its slice of a batch as a few runs of consecutive
samples, never the rest of a block: an epoch reads the dataset's bytes once, in about one
request a piece. Nothing is shared between processes: each worker computes its slots.

Resume is arithmetic: ranks step in lockstep, so progress is a number of global batches K,
found from any rank's worker counts, and any layout continues at batch K.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from . import blockplan

CHUNK = 1 << 16  # slots of a worker planned at a time
MAX_BATCHES = 1024  # local batches planned at a time (each may touch two windows, each worked out alone)


def local_size(batch: int, world: int) -> int:
    """B / W: samples of each rank's slice of a global batch, or a ValueError naming what works."""
    if world < 1 or batch % world:
        works = [w for w in range(1, min(batch, 4096) + 1) if batch % w == 0]
        shown = ", ".join(map(str, works[:12])) + (", ..." if len(works) > 12 else "")
        raise ValueError(
            f"global_batch_size={batch} does not split evenly over world size {world}: use a world size "
            f"that divides it ({shown}) or a global batch size that is a multiple of {world}"
        )
    return batch // world


Bounds = Callable[[int, int], tuple[np.ndarray, np.ndarray]]  # (lo, hi) -> the blocks meeting lo..hi-1


@dataclass(frozen=True, eq=False)
class GlobalBatches:
    """The slots of an epoch of `total` positions: `positions(slots)` says which position
    of the global sequence each slot holds. With `bounds` (where the sequence's blocks lie)
    the pieces are the halves of the blocks, so that a piece is one run of a shard; without,
    runs of `piece` positions."""

    total: int
    size: int  # B
    remainder: str
    window: int  # slots a window: a whole number of batches
    piece: int
    key: np.uint64 | None  # None: no shuffle, slot s holds position s
    bounds: Bounds | None = None

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
        win = slots // self.window
        by_window = np.argsort(win, kind="stable")
        windows, first = np.unique(win[by_window], return_index=True)
        p = np.empty_like(slots)
        for w, sel in zip(windows.tolist(), np.split(by_window, first[1:])):
            lo = w * self.window
            starts, lengths = self._pieces(w, lo, min(lo + self.window, self.slots))
            ends = np.cumsum(lengths)
            offset = slots[sel] - lo
            i = np.searchsorted(ends, offset, side="right")
            p[sel] = starts[i] + offset - (ends[i] - lengths[i])
        out = p % self.total
        return out

    def _pieces(self, w: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(first position, length) of window w's pieces, in the order the window takes them."""
        cuts = np.unique(
            np.concatenate(
                [
                    self._cuts(lo, min(hi, self.total)),
                    self.total + self._cuts(max(lo, self.total) - self.total, hi - self.total),
                    [lo],
                ]
            )
        )
        lengths = np.diff(np.append(cuts, hi))
        k = blockplan.mix64(np.array([w], dtype=np.uint64) + self.key)[0]  # type: ignore[operator]
        # whole pieces first, in a random order, the short ones (a shard's last block, the window's
        # edges) after them: pieces then start on multiples of `piece`, as the ranks' slices do
        order = np.lexsort((blockplan.hashed(k, np.arange(len(cuts))), lengths != self.piece))
        return cuts[order], lengths[order]

    def _cuts(self, lo: int, hi: int) -> np.ndarray:
        """Where pieces start among positions lo..hi-1 (below `total`): halves of blocks, or
        every `piece` positions."""
        if hi <= lo:
            return np.empty(0, dtype=np.int64)
        if self.bounds is None:
            cuts = np.arange(lo - lo % self.piece, hi, self.piece, dtype=np.int64)
        else:
            starts, stops = self.bounds(lo, hi)
            cuts = np.concatenate([starts, starts + (stops - starts + 1) // 2])
        out: np.ndarray = cuts[(cuts >= lo) & (cuts < hi)]
        return out


def plan(
    total: int,
    size: int,
    *,
    remainder: str,
    shuffle: bool,
    window: int,
    piece: int,
    seed: int,
    epoch: int,
    bounds: Bounds | None = None,
) -> GlobalBatches:
    """The global batches of an epoch: a pure function of these values, W and N aside."""
    key = blockplan.key(seed, epoch, 0x6B47, n=1)[0] if shuffle else None
    return GlobalBatches(total, size, remainder, max(1, window // size) * size, max(1, piece), key, bounds)


def worker_batches(batches: int, num_workers: int, worker_id: int) -> int:
    """Batches j < `batches` with j % num_workers == worker_id: a worker's share of a pass."""
    return max(0, -(-(batches - worker_id) // num_workers))


def worker_chunks(
    gb: GlobalBatches,
    start: int,
    world: int,
    rank: int,
    num_workers: int,
    worker_id: int,
    skip: int = 0,
    chunk: int = CHUNK,
) -> Iterator[np.ndarray]:
    """The positions worker `worker_id` of rank `rank` yields in a pass that begins at global
    batch `start`, from its `skip`-th on, a piece at a time: its rank's slice of global
    batches start + w, start + w + N, ..."""
    for slots in worker_slots(gb, start, world, rank, num_workers, worker_id, skip, chunk):
        yield gb.positions(slots)


def worker_slots(
    gb: GlobalBatches,
    start: int,
    world: int,
    rank: int,
    num_workers: int,
    worker_id: int,
    skip: int = 0,
    chunk: int = CHUNK,
) -> Iterator[np.ndarray]:
    """The slots behind `worker_chunks`' positions."""
    b = local_size(gb.size, world)
    mine = worker_batches(gb.batches - start, num_workers, worker_id)
    per = max(1, min(chunk // b, MAX_BATCHES))
    first, cut = divmod(skip, b)
    for i in range(first, mine, per):
        spans = slot_spans(gb.size, start, b, rank, num_workers, worker_id, i, min(mine, i + per))
        yield (spans[:, None] + np.arange(b)[None, :]).ravel()[cut if i == first else 0 :]


def slot_spans(
    size: int, start: int, b: int, rank: int, num_workers: int, worker_id: int, lo: int, hi: int
) -> np.ndarray:
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
        raise ValueError(
            f"worker counts {list(yielded)} are not those of a loader that handed out {done} batches of "
            f"{b} samples in turn from {num_workers} workers ({expected}): this state would resume other "
            "batches than those left (saved with a DataLoader batch_size other than global_batch_size "
            "/ world size, or edited)"
        )
    return done
