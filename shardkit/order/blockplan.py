"""An epoch's order at any position, without building the whole epoch: pure numpy.

A worker needs the samples of its own share only, so every function here maps a batch of
positions to what sits there, in time and memory proportional to the batch (plus the
number of shards), never to the dataset:

- `BlockOrder`: the global sequence of a shuffled epoch. Samples are grouped in blocks of
  `block` consecutive samples of one shard (each shard's last block may be short) and the
  blocks are permuted by `permute` (above 65,536 blocks a keyed Feistel network, which
  maps any block position to its block on its own). Only the short blocks are located up front (one per
  shard at most), which is what turns a sample position into a block position.
- `window_order`: the shuffle of a worker's stream within windows of `window` samples
  (the first ones smaller, see `ramp`), each window permuted by hashes of its stream
  indices, so that any one window can be recomputed alone (a resume needs the partial
  window of each worker, not the streams).
- `Interleave`: which part of a mixture each position of a mixed epoch draws from. Part
  d's j-th draw sits at key (j + u) / counts[d], u = 0.5 (evenly spread) or a hash in
  [0, 1) (shuffled), positions in the order of the keys; a part's draws keep their order,
  so a part's own sequence is read front to back, and any range of positions is found by
  a search over the keys.

Keys come from `key(*ints)`, so an order is a pure function of the integers it is keyed by.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MASK64 = 0xFFFF_FFFF_FFFF_FFFF
ROUNDS = 6  # Feistel rounds (4 make a pseudo-random permutation; 2 more for margin)
SMALL = 1 << 16  # up to this many values a permutation is a table
RUN_GAP = 1 << 16  # positions further apart are looked up in separate runs
_U = np.uint64


def key(*parts: int, n: int = 1) -> np.ndarray:
    """`n` 64-bit keys from integers of any size (a negative one as its 64-bit two's complement)."""
    seq = np.random.SeedSequence([p if p >= 0 else p & MASK64 for p in parts])
    return seq.generate_state(n, np.uint64)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 whose every output bit depends on every
    input bit."""
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    out: np.ndarray = x ^ (x >> _U(31))
    return out


def hashed(k: np.uint64, x: np.ndarray) -> np.ndarray:
    """A keyed hash of each element of `x` (non-negative integers)."""
    return mix64(x.astype(np.uint64) + k)


def permute(x: np.ndarray, n: int, keys: np.ndarray, inverse: bool = False) -> np.ndarray:
    """A keyed permutation of [0, n) applied to `x` (or its inverse). Up to `SMALL` values,
    the values sorted by their hashes (made whole: a few KB); above, a balanced Feistel
    network on the smallest even number of bits that holds n, walked in cycles until the
    value falls inside [0, n) again. (Feistel networks on a few bits are far from uniform:
    4 values under 6 rounds come out in some orders twice as often as in others.)"""
    if n <= SMALL:
        table = np.argsort(hashed(keys[0], np.arange(n)), kind="stable")
        if inverse:
            table = np.argsort(table)
        return table[np.asarray(x, dtype=np.int64)]
    half = ((n - 1).bit_length() + 1) // 2
    mask, shift = _U((1 << half) - 1), _U(half)
    rounds = keys[::-1] if inverse else keys
    out = x.astype(np.uint64)
    todo = np.arange(len(out))
    while len(todo):
        v = out[todo]
        left, right = v >> shift, v & mask
        for k in rounds:
            if inverse:
                left, right = right ^ (mix64(left + k) >> _U(64 - half)), left
            else:
                left, right = right, left ^ (mix64(right + k) >> _U(64 - half))
        out[todo] = (left << shift) | right
        todo = todo[out[todo] >= _U(n)]
    return out.astype(np.int64)


class BlockOrder:
    """The global sequence of an epoch: `ids(positions)` gives the sample ids (0..T-1, shard
    by shard) at those positions. `keys=None`: the samples in their own order. `block` is
    one size for every shard, or each shard's (an array: a compressed shard is one block);
    then the permuted blocks are kept as a table, memory proportional to the blocks."""

    def __init__(self, counts: np.ndarray, block: int | np.ndarray, keys: np.ndarray | None):
        counts = np.asarray(counts, dtype=np.int64)
        self.keys, self.total = keys, int(counts.sum())
        self.first = np.cumsum(counts) - counts  # id of each shard's first sample
        self._table: tuple[np.ndarray, np.ndarray] | None = None
        if isinstance(block, np.ndarray):
            self.block = 0
            if keys is not None:
                self._table = _block_table(counts, self.first, block, keys)
            return
        self.block = block
        nblocks = -(-counts // block)
        self.first_block = np.cumsum(nblocks) - nblocks
        self.blocks = int(nblocks.sum())
        short = np.flatnonzero(counts % block)  # shards whose last block is short, and by how much
        last = self.first_block[short] + nblocks[short] - 1
        where = permute(last, self.blocks, keys, inverse=True) if keys is not None else last
        by_position = np.argsort(where, kind="stable")
        deficit = np.cumsum((block - counts[short] % block)[by_position])
        self._deficit = np.append(0, deficit)  # samples missing from the short blocks up to each one
        self._short_end = block * (where[by_position] + 1) - deficit  # first position after each short block
        self._short_slot = where[by_position]  # the block positions of the short blocks, in order

    def bounds(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(first position, position after) of each block of the sequence that meets
        positions lo..hi-1, in order."""
        if hi <= lo:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        if self._table is not None:
            ends = self._table[0]
            i, j = np.searchsorted(ends, [lo, hi - 1], side="right")
            stops = ends[i : j + 1]
            return np.append(0, ends)[i : j + 1], stops
        if self.keys is None or not self.block:
            step = self.block or max(1, self.total)
            first = np.arange(lo // step * step, hi, step, dtype=np.int64)
            return first, np.minimum(first + step, self.total)
        edge = np.searchsorted(self._short_end, [lo, hi - 1], side="right")
        first_slot, last_slot = ((np.array([lo, hi - 1]) + self._deficit[edge]) // self.block).tolist()
        slots = np.arange(first_slot, last_slot + 2, dtype=np.int64)
        starts = slots * self.block - self._deficit[np.searchsorted(self._short_slot, slots, side="left")]
        return starts[:-1], np.minimum(starts[1:], self.total)

    def ids(self, positions: np.ndarray) -> np.ndarray:
        positions = np.array(positions, dtype=np.int64)  # a copy: the caller's stays theirs
        if self.keys is None or len(positions) == 0:
            return positions
        if self._table is not None:
            ends, first_ids = self._table
            slot = np.searchsorted(ends, positions, side="right")
            found: np.ndarray = first_ids[slot] + positions - np.append(0, ends)[slot]
            return found
        # short blocks wholly before each position, searched among those of the positions' stretch
        lo, hi = np.searchsorted(self._short_end, [positions.min(), positions.max()], side="right")
        before = lo + np.searchsorted(self._short_end[lo:hi], positions, side="right")
        slot, offset = np.divmod(positions + self._deficit[before], self.block)
        ids: np.ndarray = _once_each(slot, self._first_id) + offset
        return ids

    def _first_id(self, slots: np.ndarray) -> np.ndarray:
        """The first sample of the block at each block position."""
        blocks = permute(slots, self.blocks, self.keys)  # type: ignore[arg-type]
        shard = np.searchsorted(self.first_block, blocks, side="right") - 1
        first: np.ndarray = self.first[shard] + (blocks - self.first_block[shard]) * self.block
        return first


def _block_table(
    counts: np.ndarray, first: np.ndarray, block: np.ndarray, keys: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of `block[s]` samples of each shard s, permuted by `keys`: the position after
    each block in the epoch, and its first sample."""
    nblocks = -(-counts // np.maximum(block, 1))
    size = np.repeat(block, nblocks)
    within = np.arange(int(nblocks.sum()), dtype=np.int64) - np.repeat(np.cumsum(nblocks) - nblocks, nblocks)
    starts = np.repeat(first, nblocks) + size * within
    lengths = np.minimum(starts + size, np.repeat(first + counts, nblocks)) - starts
    order = permute(np.arange(len(starts)), len(starts), keys)
    return np.cumsum(lengths[order]), starts[order]


def _once_each(x: np.ndarray, f: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """f(x), computed once per value: over the stretch of values x spans where that is short
    (a worker's samples fill a stretch of blocks), else over x's distinct values."""
    lo, hi = int(x.min()), int(x.max())
    if hi - lo < 2 * len(x) + 1024:
        out: np.ndarray = f(np.arange(lo, hi + 1, dtype=np.int64))[x - lo]
        return out
    values, inverse = np.unique(x, return_inverse=True)
    out = f(values)[inverse]
    return out


def ramp(window: int) -> np.ndarray:
    """Where a worker's first windows start: they grow from `window / 8`, doubling up to
    `window` (the first batch then needs the bytes of two or three blocks, not of every
    block a whole window spans); the last entry is where windows of `window` begin."""
    starts, size = [0], max(1, window // 8)
    while size < window:
        starts.append(starts[-1] + size)
        size *= 2
    return np.array(starts, dtype=np.int64)


def window_of(index: np.ndarray, window: int) -> np.ndarray:
    """The window each stream index falls in (see `ramp`): 0, 1, ... in stream order."""
    starts = ramp(window)
    index = np.asarray(index, dtype=np.int64)
    steady = starts[-1]
    early = np.searchsorted(starts, index, side="right") - 1
    out: np.ndarray = np.where(index < steady, early, len(starts) - 1 + (index - steady) // window)
    return out


def window_bounds(index: int, window: int) -> tuple[int, int]:
    """The first stream index of the window that holds `index`, and the one after it."""
    starts = ramp(window)
    if index < starts[-1]:
        w = int(np.searchsorted(starts, index, side="right")) - 1
        return int(starts[w]), int(starts[w + 1])
    first = int(starts[-1] + (index - starts[-1]) // window * window)
    return first, first + window


def window_order(k: np.uint64, start: int, stop: int, window: int) -> np.ndarray:
    """Indices start..stop-1 of a stream (`start` the first of a window) in shuffled order:
    each window (see `ramp`) permuted, by hashes of the indices under key `k`."""
    idx = np.arange(start, stop, dtype=np.int64)
    order = np.lexsort((hashed(k, idx), window_of(idx, window)))  # by window, then by hash within it
    out: np.ndarray = idx[order]
    return out


class Interleave:
    """The positions of a mixed epoch: part d fills counts[d] of them. `at(lo, hi)` gives
    the (part, draw) of positions lo..hi-1; `keys=None` spreads each part evenly."""

    def __init__(self, counts: np.ndarray, keys: np.ndarray | None):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.total = int(self.counts.sum())
        self._k = None if keys is None else keys[0]

    def _key(self, part: np.ndarray, draw: np.ndarray) -> np.ndarray:
        """Each draw's place in the epoch, in [0, 1]: increasing with the draw in a part."""
        if self._k is None:
            u = 0.5
        else:
            u = (hashed(self._k, part * (1 << 40) + draw) >> _U(11)).astype(np.float64) * 2.0**-53
        where: np.ndarray = (draw + u) / self.counts[part]
        return where

    def _at_most(self, x: float) -> np.ndarray:
        """Draws of each part with a key <= x. A key lies in [j, j + 1) / counts, so only a
        few draws around x * counts need a look."""
        parts = np.arange(len(self.counts))
        guess = np.minimum(np.floor(x * self.counts).astype(np.int64), self.counts)
        low = np.maximum(guess - 2, 0)
        n = low.copy()
        for step in range(5):
            draw = low + step
            inside = draw < self.counts
            n += inside & (self._key(parts, np.minimum(draw, self.counts - 1)) <= x)
        out: np.ndarray = n
        return out

    def before(self, position: int) -> np.ndarray:
        """Draws of each part at positions before `position`: the draws are ordered by
        (key, part, draw), and the key of the draw at `position` is found by bisecting the
        floats in [0, 1] (in their bit patterns, which sort as the floats do)."""
        if position <= 0:
            return np.zeros_like(self.counts)
        if position >= self.total:
            return np.array(self.counts)
        lo, hi = 0, int(np.float64(1.0).view(np.int64))  # smallest x with more than `position` keys <= x
        while lo < hi:
            mid = (lo + hi) // 2
            if int(self._at_most(float(np.int64(mid).view(np.float64))).sum()) > position:
                hi = mid
            else:
                lo = mid + 1
        x = float(np.int64(lo).view(np.float64))
        below = self._at_most(float(np.nextafter(x, -1.0))) if lo else np.zeros_like(self.counts)
        tied = self._at_most(x) - below
        taken = np.clip(position - int(below.sum()) - (np.cumsum(tied) - tied), 0, tied)
        out: np.ndarray = below + taken
        return out

    def at(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(part, draw within the part) of positions lo..hi-1."""
        first, last = self.before(lo), self.before(hi)
        n = last - first
        part = np.repeat(np.arange(len(n)), n)
        draw = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n - first, n)
        order = np.lexsort((draw, part, self._key(part, draw)))
        return part[order], draw[order]

    def draws(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`at` for any positions: looked up run by run, a run being positions less than
        `RUN_GAP` apart (a worker's positions fill a few ranges of the epoch)."""
        sort = np.argsort(positions, kind="stable")
        p = positions[sort]
        part, draw = np.empty(len(p), dtype=np.int64), np.empty(len(p), dtype=np.int64)
        cuts = np.flatnonzero(np.diff(p) > RUN_GAP) + 1
        for lo, hi in zip(np.append(0, cuts).tolist(), np.append(cuts, len(p)).tolist()):
            if lo == hi:
                continue
            first = int(p[lo])
            run_part, run_draw = self.at(first, int(p[hi - 1]) + 1)
            part[sort[lo:hi]], draw[sort[lo:hi]] = run_part[p[lo:hi] - first], run_draw[p[lo:hi] - first]
        return part, draw
