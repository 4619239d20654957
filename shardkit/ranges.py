"""Which byte ranges a worker reads, and in which order, to deliver its samples.

A worker knows its whole stream in advance (partition.py), so reads can be planned: runs of
samples that sit back to back in a shard are read as one range, up to `max_bytes`.

- "emission" order reads ranges in the order samples are yielded: a shuffled stream reads
  sample by sample, an unshuffled one in large sequential ranges. Nothing waits in memory
  beyond the read-ahead. Right for local disk.
- "sorted" order sorts each shuffle window by position before grouping, so a window of
  samples from a few blocks becomes a few large reads: the way to read an object store,
  where every request pays a first-byte latency. The window's bytes are held until its last
  sample is yielded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ORDERS = ("emission", "sorted")


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


def plan(shard_of: np.ndarray, starts: np.ndarray, ends: np.ndarray, *, window: int, order: str,
         max_bytes: int) -> tuple[list[Range], np.ndarray]:
    """(ranges in read order, the range index of each sample of the stream)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    n = len(shard_of)
    range_of = np.empty(n, dtype=np.int64)
    ranges: list[Range] = []
    for lo in range(0, n, window):
        positions = np.arange(lo, min(lo + window, n))
        if order == "sorted":
            positions = positions[np.lexsort((starts[positions], shard_of[positions]))]
        shard_l, start_l, end_l = shard_of[positions].tolist(), starts[positions].tolist(), ends[positions].tolist()
        current: list[int] = []  # [shard, start, stop, samples] of the range being grown
        for pos, shard, start, end in zip(positions.tolist(), shard_l, start_l, end_l):
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
