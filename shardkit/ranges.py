"""Which byte ranges a worker reads, and in which order, to deliver its samples.

A worker knows its whole stream in advance (partition.py), so its reads can be planned:

- `coalesce`: read in the order samples are yielded, merging samples that sit back to back
  in a shard into one range (up to `max_bytes`). A shuffled stream reads sample by sample,
  an unshuffled one in large sequential ranges, and nothing waits in memory beyond the
  read-ahead. Right for local disk.
- `blocks`: read whole blocks (the `block` consecutive samples of a shard that the shuffle
  moves together), each once, in the order the stream first needs them. A shuffle window
  spans a few blocks, so an object store sees a few large requests instead of one per
  sample, and a block has the same byte range in every epoch and layout, so it can be
  cached. A block's bytes are held until its last sample in the stream is yielded.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def coalesce(shard_of: np.ndarray, starts: np.ndarray, ends: np.ndarray, max_bytes: int) -> tuple[list[Range], np.ndarray]:
    """(ranges in read order, the range index of each sample of the stream)."""
    range_of = np.empty(len(shard_of), dtype=np.int64)
    ranges: list[Range] = []
    current: list[int] = []  # [shard, start, stop, samples] of the range being grown
    for pos, (shard, start, end) in enumerate(zip(shard_of.tolist(), starts.tolist(), ends.tolist())):
        if current and shard == current[0] and start == current[2] and end - current[1] <= max_bytes:
            current[2] = end
            current[3] += 1
        else:
            if current:
                ranges.append(Range(len(ranges), *current))
            current = [shard, start, end, 1]
        range_of[pos] = len(ranges)
    if current:
        ranges.append(Range(len(ranges), *current))
    return ranges, range_of


def blocks(ids: np.ndarray, first: np.ndarray, all_starts: np.ndarray, all_ends: np.ndarray,
           block: int) -> tuple[list[Range], np.ndarray]:
    """Whole-block ranges for the stream `ids` (global sample ids). `first[s]` is the id of
    shard s's first sample (with the total appended); `all_starts`/`all_ends` are every
    sample's byte bounds within its shard."""
    shard_of = np.searchsorted(first, ids, side="right") - 1
    block_of = (ids - first[shard_of]) // block
    key = shard_of * (int(block_of.max(initial=0)) + 1) + block_of
    uniq, first_pos, range_of, counts = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    order = np.argsort(first_pos, kind="stable")  # read blocks in the order first needed
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    ranges = []
    for i, u in enumerate(order.tolist()):
        pos = int(first_pos[u])
        shard, b = int(shard_of[pos]), int(block_of[pos])
        lo = int(first[shard]) + b * block
        hi = min(lo + block, int(first[shard + 1])) - 1
        ranges.append(Range(i, shard, int(all_starts[lo]), int(all_ends[hi]), int(counts[u])))
    return ranges, rank[range_of.reshape(-1)]
