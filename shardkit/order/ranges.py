"""Which byte ranges a worker reads, and in which order, to deliver its samples.

A worker knows its whole stream in advance (partition.py), so its reads can be planned:

- `coalesce`: read in the order samples are yielded, merging samples that sit back to back
  in a shard into one range (cut at every `max_bytes` of the shard, so a range is at most
  `max_bytes` plus one sample). A shuffled stream reads sample by sample,
  an unshuffled one in large sequential ranges, and nothing waits in memory beyond the
  read-ahead. Right for local disk.
- `blocks`: read whole blocks (the `block` consecutive samples of a shard that the shuffle
  moves together), each once, in the order the stream first needs them. A shuffle window
  spans a few blocks, so an object store sees a few large requests instead of one per
  sample, and a block has the same byte range in every epoch and layout, so it can be
  cached. A block's bytes are held until its last sample in the stream is yielded, or
  read again where the stream comes back to it much later. Blocks read one after another
  that are back to back in their shard are read as one range, toward the 8-16 MB per request
  that object stores are fastest with.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Range:
    index: int  # position in the read order
    shard: int
    start: int
    stop: int
    samples: int  # samples of the stream served by this range

    @property
    def size(self) -> int:
        return self.stop - self.start


def rows(*columns: np.ndarray, chunk: int = 256) -> Iterator[tuple[Any, ...]]:
    """`zip` of the columns as Python numbers, converted a chunk at a time: a worker's
    stream stays in numpy arrays (8 bytes a number), never whole lists of int objects
    (~36 bytes each, held for the whole pass). A small chunk: a mixture's worker holds one
    of each of its parts' streams (4,096 rows cost ~1 MB a part)."""
    for lo in range(0, len(columns[0]), chunk):
        yield from zip(*(c[lo : lo + chunk].tolist() for c in columns))


def _ranges(shard: np.ndarray, start: np.ndarray, stop: np.ndarray, samples: np.ndarray) -> Iterator[Range]:
    """Range objects made as the read-ahead takes them (a stream can have millions)."""
    for i, r in enumerate(rows(shard, start, stop, samples)):
        yield Range(i, *r)


def _runs(shard: np.ndarray, start: np.ndarray, stop: np.ndarray, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(first item, range index of each item) of ranges merging items that sit back to back
    in a shard, cut at every `max_bytes` from a run's first byte."""
    n = len(shard)
    new_run = np.ones(n, dtype=bool)  # a new run wherever the next item is not right behind the previous one
    new_run[1:] = (shard[1:] != shard[:-1]) | (start[1:] != stop[:-1])
    run_first = np.flatnonzero(new_run)
    piece = (stop - start[run_first[np.cumsum(new_run) - 1]] - 1) // max_bytes
    new_range = new_run.copy()
    new_range[1:] |= piece[1:] != piece[:-1]
    return np.flatnonzero(new_range), np.cumsum(new_range) - 1


def coalesce(
    shard_of: np.ndarray, starts: np.ndarray, ends: np.ndarray, max_bytes: int
) -> tuple[Iterator[Range], np.ndarray]:
    """(ranges in read order, the range index of each sample of the stream)."""
    n = len(shard_of)
    if n == 0:
        return iter(()), np.empty(0, dtype=np.int64)
    first, range_of = _runs(shard_of, starts, ends, max_bytes)
    last = np.append(first[1:], n) - 1
    return _ranges(shard_of[first], starts[first], ends[last], last - first + 1), range_of


def bounds(ids: np.ndarray, first: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(shard, first byte, end) of each sample of `ids` (global sample ids). `first[s]` is
    the id of shard s's first sample (with the total appended); `offsets` holds every
    shard's offset table back to back, each one entry longer than its shard has samples, so
    sample i of shard s spans bytes offsets[i + s] to offsets[i + s + 1]: 8 bytes a sample."""
    shard_of = np.searchsorted(first, ids, side="right") - 1
    at = ids + shard_of
    return shard_of, offsets[at], offsets[at + 1]


def blocks(
    ids: np.ndarray,
    first: np.ndarray,
    offsets: np.ndarray,
    block: int,
    max_gap: int | None = None,
    max_bytes: int | None = None,
) -> tuple[Iterator[Range], np.ndarray]:
    """Whole-block ranges for the stream `ids` (global sample ids); `first` and `offsets`
    as in `bounds`. A block needed again more than `max_gap` samples after its previous
    sample (a mix drawing a part more than once an epoch) is read again, not held between.
    With `max_bytes`, blocks read one after the other that sit back to back in their shard
    (an unshuffled stream's) are read as one range, of up to `max_bytes` (plus a block)."""
    n = len(ids)
    shard_of = np.searchsorted(first, ids, side="right") - 1
    block_of = (ids - first[shard_of]) // block
    key = shard_of * (int(block_of.max(initial=0)) + 1) + block_of
    by_key = np.lexsort((np.arange(n), key))  # stream positions, each block's together and in order
    new_use = np.ones(n, dtype=bool)
    new_use[1:] = key[by_key[1:]] != key[by_key[:-1]]
    if max_gap is not None:
        new_use[1:] |= np.diff(by_key) > max_gap
    use_start = np.flatnonzero(new_use)
    counts = np.diff(np.append(use_start, n))
    use_of = np.empty(n, dtype=np.int64)
    use_of[by_key] = np.cumsum(new_use) - 1
    first_pos = by_key[use_start]  # each use's first sample in the stream
    order = np.argsort(first_pos, kind="stable")  # read blocks in the order first needed
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    pos = first_pos[order]
    shards, blk = shard_of[pos], block_of[pos]
    lo = first[shards] + blk * block
    hi = np.minimum(lo + block, first[shards + 1])  # one past the block's last sample
    starts, stops, samples = offsets[lo + shards], offsets[hi + shards], counts[order]
    if max_bytes is None or n == 0:
        return _ranges(shards, starts, stops, samples), rank[use_of]
    head, merged = _runs(shards, starts, stops, max_bytes)  # blocks read one after the other, back to back
    tail = np.append(head[1:], len(shards)) - 1
    return _ranges(shards[head], starts[head], stops[tail], np.add.reduceat(samples, head)), merged[rank[use_of]]
