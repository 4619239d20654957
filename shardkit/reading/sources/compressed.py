"""gzip-compressed shards in a pass: read as streams, never by random access.

A compressed shard has no byte ranges to fetch: a range of the tar inside is had by
inflating the file from its start (formats/gzip.Ranges). So the shuffle keeps each
compressed shard's samples together (one block: shards in shuffled order, samples in a
shuffle window, as webdataset shuffles), and a worker reads each one through one `Ranges`,
fetching the compressed file in chunks through its RangeReader (pread locally; ranged GETs,
retried and cached like any block, remotely). A pass inflates each shard once; samples
read a little out of order (the window) come from the last `keep` bytes inflated.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from ... import storage
from ...errors import CorruptShardError
from ...formats.gzip import Fetch, Ranges
from ...index import ShardInfo

CHUNK = 8 << 20  # compressed bytes a fetch asks for: a few requests a shard, each a cacheable block


def check_samples(
    urls: Sequence[str], shards: Sequence[ShardInfo], first: np.ndarray, offsets: np.ndarray, limit: int
) -> int:
    """The largest mean sample size of a compressed shard (0: none is compressed), from every
    shard's offset table back to back (`offsets`; shard i's samples start at sample
    `first[i]`). Refuses one whose index has a sample larger than `limit` (a decompression
    bomb, or one to allow with a larger max_member_size): it would be inflated into memory
    whole."""
    largest = 0
    for i, (url, info) in enumerate(zip(urls, shards)):
        if info.compression is None or not info.samples:
            continue
        table = np.asarray(offsets[first[i] + i : first[i + 1] + i + 1], dtype=np.int64)
        sizes = np.diff(table)
        j = int(np.argmax(sizes))
        if sizes[j] > limit:
            raise CorruptShardError(
                f"{storage.display(url)}: sample {j} inflates to {sizes[j]} bytes (at byte "
                f"{table[j]} of its tar), over max_member_size ({limit} bytes)"
            )
        largest = max(largest, -(-int(table[-1] - table[0]) // info.samples))
    return largest


def blocks(shards: Sequence[ShardInfo], block: int) -> int | np.ndarray:
    """The shuffle's block per shard: a compressed shard's samples all, `block` for others
    (an int where no shard is compressed)."""
    if not any(s.compression for s in shards):
        return block
    return np.array([max(s.samples, 1) if s.compression else block for s in shards], dtype=np.int64)


class CompressedShards:
    """Ranges of the tar inside each compressed shard of `shards`, read through `reader`.
    A worker's reads of a shard come within `spread` samples of each other (a shuffle
    window and a block or two) and its samples are `sample_bytes` long at most on average:
    each stream keeps that many samples' bytes, and as many streams stay open as `spread`
    samples can span shards. Thread-safe: read-ahead threads take turns on a shard."""

    def __init__(
        self,
        reader: storage.RangeReader,
        urls: Sequence[str],
        shards: Sequence[ShardInfo],
        spread: int,
        sample_bytes: int,
    ):
        self._reader, self._urls, self._keep = reader, urls, spread * sample_bytes
        self._sizes = {i: s.bytes for i, s in enumerate(shards) if s.compression}
        smallest = min((max(shards[i].samples, 1) for i in self._sizes), default=1)
        self._open = 2 + spread // smallest
        self._streams: OrderedDict[int, Ranges] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, shard: int) -> bool:
        return shard in self._sizes

    def read(self, shard: int, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the tar inside; fewer where it ends before `stop`."""
        return self._stream(shard).read(start, stop)

    def _stream(self, shard: int) -> Ranges:
        with self._lock:
            stream = self._streams.get(shard)
            if stream is None:
                stream = self._streams[shard] = Ranges(
                    self._fetcher(shard), storage.display(self._urls[shard]), self._keep, CHUNK
                )
                while len(self._streams) > self._open:
                    self._streams.popitem(last=False)
            self._streams.move_to_end(shard)
            return stream

    def _fetcher(self, shard: int) -> Fetch:
        size, read = self._sizes[shard], self._reader.read

        def fetch(offset: int, n: int) -> bytes:
            return read(shard, offset, min(offset + n, size), partial=True) if offset < size else b""

        return fetch
