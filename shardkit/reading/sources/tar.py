"""Tar shards' samples: each sample's byte range from the index's offsets, read ahead in
merged ranges (advised locally, streamed remotely), compressed shards through their streams."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from ... import index, storage
from ...decode import sample_dict
from ...errors import CorruptShardError
from ...formats.gzip import MAX_MEMBER, inflate_fields
from ...formats.tar_sample import ReadAt, buffer_reader, read_sample
from ...index import Index, offsets
from ...order import blockplan, ranges
from ...storage import StorageOptions
from ...storage.streams import Arriving, Stalls
from ..prefetch import Prefetcher
from ..spec import ReadAhead
from . import compressed
from .base import Read, Settings, gz_fields
from .compressed import CompressedShards

RANGE_BYTES = 16 << 20  # the most bytes one read merges (AWS: 8-16 MB requests are fastest; locally one advise)


class TarSamples:
    """Tar shards: each sample's byte range, from the index's offsets (the offsets file mapped
    into memory, or a version 1 index's tables)."""

    format = "tar"

    @classmethod
    def of(
        cls,
        idx: Index,
        urls: list[str],
        storage_options: StorageOptions | None,
        cache_dir: str | None,
        cache_limit: int,
        max_member: int = MAX_MEMBER,
    ) -> TarSamples:
        """The registry's constructor, the same for every source (shards are read in place:
        no cache limit)."""
        return cls(idx, urls, storage_options, cache_dir, max_member)

    def __init__(
        self,
        idx: Index,
        urls: list[str],
        storage_options: StorageOptions | None,
        cache_dir: str | None,
        max_member: int = MAX_MEMBER,
    ):
        counts = np.array([s.samples for s in idx.shards], dtype=np.int64)
        self.urls, self.bytes, self.max_member = urls, idx.bytes, max_member
        self.gz = gz_fields(idx)
        self.shards = idx.slim().shards  # which are compressed, and their files' sizes
        # a compressed shard's offsets are in the tar inside, whose size the index does not record
        self.shard_bytes = np.array(
            [np.iinfo(np.int64).max if s.compression else s.bytes for s in idx.shards], dtype=np.int64
        )
        self.first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._table = index.sample_offsets(idx, storage_options, cache_dir)
        self.sample_bytes = compressed.check_samples(urls, self.shards, self.first, self.offsets, max_member)
        self._held: tuple[storage.RangeReader, CompressedShards] | None = None  # see _streams

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_held": None}

    def _streams(self, reader: storage.RangeReader, spread: int = 0, sample_bytes: int = 0) -> CompressedShards:
        """The compressed shards' streams of `reader`'s pass, made once: a sample read on its
        own in the pass (`one`, standing in for a skipped one) continues them rather than
        inflating its shard again from the start."""
        if self._held is None or self._held[0] is not reader:
            self._held = (reader, CompressedShards(reader, self.urls, self.shards, spread, sample_bytes))
        return self._held[1]

    @property
    def offsets(self) -> np.ndarray:
        """Every shard's offset table back to back (the offsets file mapped in this process)."""
        table = self._table
        return table.array if isinstance(table, offsets.Offsets) else table

    def reads(
        self,
        ids: np.ndarray,
        reader: storage.RangeReader,
        opts: Settings,
        window: int,
    ) -> tuple[Generator[Read, None, None], Prefetcher[Any, Any] | None]:
        ahead = opts.read_ahead
        shard_of, starts, ends = ranges.bounds(ids, self.first, self.offsets)
        self._check(shard_of, starts, ends)
        local = all(map(storage.is_local, self.urls))  # one remote shard: its ranges go through the budget
        plan, range_of = self._plan(ids, (shard_of, starts, ends), local or opts.global_batches, ahead, window)
        # compressed shards: reads within a shuffle window (and a block each side) come out of order
        streams = self._streams(reader, window + 2 * ahead.block, self.sample_bytes)

        def inflated(r: ranges.Range) -> ReadAt | CorruptShardError:
            """A compressed shard's range: inflated from where its stream is up to the range."""
            try:
                return buffer_reader(streams.read(r.shard, r.start, r.stop), r.start)
            except CorruptShardError as e:  # each sample of the range raises it in turn: skipped or raised
                return e

        if local:

            def advise(r: ranges.Range) -> ReadAt | CorruptShardError:
                if r.shard in streams:
                    return inflated(r)
                try:  # the kernel reads the range ahead; samples come straight from the file
                    reader.advise(r.shard, r.start, r.stop)
                    return reader.read_at(r.shard)
                except CorruptShardError as e:  # each sample of the range raises it in turn: skipped or raised
                    return e

            depth = ahead.depth(local=True)
            prefetcher: Prefetcher[ranges.Range, Any] = Prefetcher(
                plan, advise, lambda r: r.size, depth=depth, budget=ahead.prefetch_bytes, threads=False
            )
        else:
            stalls = Stalls()

            def stream(r: ranges.Range, hand_over: Callable[[ReadAt], None]) -> ReadAt | CorruptShardError:
                if r.shard in streams:
                    return inflated(r)
                arriving = Arriving(r.start, r.stop, stalls)
                hand_over(arriving)  # samples are parsed as their bytes arrive
                reader.stream(r.shard, r.start, r.stop, arriving)  # an error: raised by the samples it concerns
                return arriving

            # a shuffled stream's first window takes its samples from every range it spans, in turn
            first = len(np.unique(range_of[: blockplan.ramp(window)[1] if window > 1 else 1]))
            # a global batch's ranges are half blocks
            depth = ahead.depth(local=False) * (2 if opts.global_batches else 1)
            prefetcher = _streaming(plan, stream, stalls, reader, ahead.prefetch_bytes, depth, first)
            reader.engine.wanted = lambda: (prefetcher.rate, prefetcher.waiting)  # what a range's pieces must carry
        return _in_order(prefetcher, range_of, shard_of, starts, ends), prefetcher

    def _plan(
        self,
        ids: np.ndarray,
        bounds: tuple[np.ndarray, np.ndarray, np.ndarray],
        own_bytes: bool,
        ahead: ReadAhead,
        window: int,
    ) -> tuple[Iterator[ranges.Range], np.ndarray]:
        """(the ranges to read, in order; the range of each sample): with `own_bytes` (local
        shards, or a global batch's pieces) each sample's own bytes, merged with its
        neighbours'; else whole blocks."""
        if own_bytes:  # a global batch's pieces: their own samples, not whole blocks
            return ranges.coalesce(*bounds, max_bytes=RANGE_BYTES)
        # a block's samples come within block + 2 windows of each other: further apart, a new use,
        # read again rather than held, unless the whole dataset fits in the read-ahead budget
        gap = None if self.bytes <= ahead.prefetch_bytes else ahead.block + 2 * window
        return ranges.blocks(ids, self.first, self.offsets, ahead.block, gap, max_bytes=RANGE_BYTES)

    def _check(self, shard_of: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> None:
        """Offsets that cannot be the samples of their shard (an offsets file replaced or damaged:
        it is mapped, not read whole) fail before the first read, naming the shard."""
        sizes = self.shard_bytes[shard_of]
        bad = np.flatnonzero((starts < 0) | (ends <= starts) | (ends > sizes))
        if len(bad):
            i = int(bad[0])
            raise CorruptShardError(
                f"{storage.display(self.urls[int(shard_of[i])])}: the index's offsets put a "
                f"sample at bytes {starts[i]}-{ends[i]} of the shard's {sizes[i]}"
            )

    def parse(self, data: tuple[int, ReadAt], url: str, start: int) -> tuple[dict[str, Any], int]:
        stop, read_at = data
        key, fields = read_sample(read_at, start, stop, _Where(url, start))  # a local sample's bytes are read here
        sample = sample_dict(key, url, fields)
        if self.gz:
            inflate_fields(sample, self.max_member)
        return sample, stop - start

    def position(self, start: int) -> str:
        return f" at byte {start}"

    def one(self, i: int, reader: storage.RangeReader) -> dict[str, Any]:
        """Sample `i` on its own: one pread of a local shard, one ranged read of a remote one
        (a compressed one from its stream of this reader, inflated up to the sample)."""
        shard, start, end = (int(x[0]) for x in ranges.bounds(np.array([i]), self.first, self.offsets))
        if self.shards[shard].compression:
            read_at = buffer_reader(self._streams(reader).read(shard, start, end), start)
        elif reader.is_local(shard):
            read_at = reader.read_at(shard)
        else:
            read_at = buffer_reader(reader.read(shard, start, end), start)
        return self.parse((end, read_at), self.urls[shard], start)[0]


def _streaming(
    plan: Iterator[ranges.Range],
    stream: Callable[..., Any],
    stalls: Stalls,
    reader: storage.RangeReader,
    budget: int,
    depth: int,
    first: int,
) -> Prefetcher[ranges.Range, Any]:
    """The read-ahead of remote ranges, streamed: told of the store's throttling, of the
    worker's waits for bytes (and called while it waits: more reads then) and of the reader's
    round trips and bytes."""
    prefetcher = Prefetcher(
        plan,
        stream,
        lambda r: r.size,
        depth=depth,
        budget=budget,
        streaming=True,
        pressure=lambda: reader.throttled,
        start=first,
        stalled=lambda: stalls.seconds,
        round_trip=lambda: reader.engine.latency_s,
        arrived=lambda: reader.fetched_bytes,
    )
    stalls.waiting = prefetcher.stalling
    return prefetcher


def _in_order(
    prefetcher: Prefetcher[ranges.Range, Any],
    range_of: np.ndarray,
    shard_of: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
) -> Generator[Read, None, None]:
    """(shard, start, (stop, read_at)) for each planned sample, its range's read_at held
    until its last sample is out (a streamed range's buffer then released for the next);
    the range's error in place of (stop, read_at)."""
    fetched = iter(prefetcher)
    held: dict[int, tuple[Any, list[int]]] = {}  # range index -> its read_at (or error), samples left
    for r, shard, start, end in ranges.rows(range_of, shard_of, starts, ends):
        while r not in held:
            got, read_at = next(fetched)
            held[got.index] = (read_at, [got.samples])
        read_at, left = held[r]
        yield shard, start, read_at if isinstance(read_at, CorruptShardError) else (end, read_at)
        left[0] -= 1
        if not left[0]:
            del held[r]
            if isinstance(read_at, Arriving):
                read_at.release()


class _Where:
    """Names a sample in error messages; formatted only when one is raised."""

    __slots__ = ("url", "start")

    def __init__(self, url: str, start: int):
        self.url, self.start = url, start

    def __str__(self) -> str:
        return f"{storage.display(self.url)} (sample at byte {self.start})"
