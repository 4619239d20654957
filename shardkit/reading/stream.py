"""One pass of one worker of a StreamingDataset, as stages:

    read ranges -> parse samples -> decode -> transform

`_reads` / `_lmdb_reads` yield each planned sample's bytes in order (read ahead by the
prefetcher); `_process` parses, decodes and transforms one sample, timing each stage;
`bad_sample` is the one policy that decides whether a failure is skipped or raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import ranges, storage
from ..decode import decoder, sample_dict
from ..errors import CorruptShardError, FieldError, ShardkitError, describe
from ..formats import lmdb as lmdb_format
from ..formats.tar import ReadAt, buffer_reader, read_sample
from ..prefetch import Prefetcher
from ..storage.cache import RangeCache
from .counters import Meter
from .epochs import EpochStream

if TYPE_CHECKING:
    from .dataset import StreamingDataset

log = logging.getLogger("shardkit")
SKIPS_LOGGED = 10  # a worker's first skipped samples are logged (a warning each), the rest only counted
LMDB_WINDOW = 64  # samples of an LMDB dataset that one read from the disk sends to the threads

Read = tuple[int, int, Any]  # (shard, start, the sample's bytes or the error of its range)
Transform = Callable[[dict[str, Any]], Any]


def bad_sample(e: BaseException, on_error: str, url: str, where: str, in_transform: bool) -> str:
    """The one policy for a sample that failed: returns the line to log when it is skipped,
    raises when it is not. Skipped under ``on_error="skip"``: bad data only (a corrupt
    shard, an undecodable field, a FieldError from a transform). Never skipped: a failing
    disk or store, MemoryError, and the transform's own errors."""
    if isinstance(e, MemoryError) or (in_transform and not isinstance(e, FieldError)):
        raise e  # the machine's, or user code's: its errors are its own
    if isinstance(e, ShardkitError) and (on_error == "raise" or not isinstance(e, CorruptShardError)):
        raise e  # named already; a failing disk or store is never skipped as bad data
    said = str(e) if isinstance(e, CorruptShardError) else f"{storage.display(url)}: {where}: {describe(e)}"
    if on_error == "raise":
        raise CorruptShardError(said) from e
    return said


class WorkerStream(EpochStream):
    """One pass of one worker of a StreamingDataset: plans, reads, decodes, transforms."""

    ds: StreamingDataset

    def __init__(self, ds: StreamingDataset, rank: int, world: int, worker_id: int, num_workers: int,
                 ids: np.ndarray | None = None, window: int | None = None):
        super().__init__(ds, rank, world, worker_id, num_workers, fixed=ids)
        self.prefetcher: Prefetcher[ranges.Range, Any] | None = None  # set once reading starts
        self.window = window or ds.shuffle_window  # the window that spreads this stream's samples (a mix's)
        self._key: str | None = None  # the sample being processed, once parsed: named if it fails
        self._in_transform = False  # ...and whether it failed in the user's transform

    def _generate(self) -> Iterator[Any]:
        ds = self.ds
        ids = self._plan()
        cache = RangeCache(ds.cache_dir, ds.cache_limit) if ds.cache_dir is not None else None
        versions = [sh.sha256 for sh in ds.index.shards]
        # the dataset read its index (or scanned its shards) there: the store was reachable
        reader = storage.RangeReader(ds.urls, ds.storage_options, versions, cache, verify=ds.verify, patient=True)
        decode, transform = decoder(ds.decode, ds.backend), ds.transform
        reads = self._reads(ids, reader) if ds._lmdb is None else self._lmdb_reads(ids)
        meter = Meter(ds._shared, self.worker_id, reader, cache)
        pending = 0  # skipped samples still to be replaced, so the rank's count stays exact
        try:
            for count in range(1, len(ids) + 1):
                shard, start, data = next(reads)
                try:
                    item = self._process(shard, start, data, decode, transform, meter)
                except Exception as e:  # noqa: BLE001 - bad data, reported with the shard and sample named
                    said = bad_sample(e, ds.on_error, ds.urls[shard], self._where(start), self._in_transform)
                    meter.skipped()
                    pending += 1
                    if meter.skips <= SKIPS_LOGGED:
                        more = " (this worker's further skips are counted in stats() only)" * (meter.skips == SKIPS_LOGGED)
                        log.warning("skipped %s%s", said, more)
                    continue
                for _ in range(pending + 1):
                    yield item
                pending = 0
                if count % 256 == 0:
                    meter.flush(self.prefetcher)
            if pending:  # bad samples at the end of the plan: a stand-in that a resumed pass picks too
                stand_in = self._borrow(reader, decode, transform, int(ids[-1]))
                for _ in range(pending):
                    yield stand_in
        finally:
            reads.close()
            meter.flush(self.prefetcher)
            reader.close()

    def _process(self, shard: int, start: int, data: Any, decode: Callable[[dict[str, Any]], Any],
                 transform: Transform | None, meter: Meter) -> Any:
        """One sample through parse -> decode -> transform, each stage timed."""
        self._key, self._in_transform = None, False
        if isinstance(data, CorruptShardError):
            raise data
        t0 = time.perf_counter()
        url = self.ds.urls[shard]
        if self.ds._lmdb is None:
            sample, size = _parse(data, url, start), data[0] - start  # a local sample's bytes are read here
        else:
            sample, size = _from_lmdb(data, url, start), sum(map(len, data[1].values()))
        t1 = time.perf_counter()
        self._key = sample["__key__"]
        sample = decode(sample)
        t2 = time.perf_counter()
        self._in_transform = True
        item = transform(sample) if transform is not None else sample
        meter.sample(size, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return item

    def _where(self, start: int) -> str:
        """The failing sample, for `bad_sample`'s message."""
        key = self._key
        where = f"sample {key}" if key is not None else "a sample"
        return where + (f" at byte {start}" if self.ds._lmdb is None else "")

    def _borrow(self, reader: storage.RangeReader, decode: Callable[[dict[str, Any]], Any],
                transform: Transform | None, after: int) -> Any:
        """The first usable sample after global id `after` (wrapping), standing in for
        skipped samples at the end of a worker's plan, so that the rank's count stays exact
        and a resumed pass picks the same one. Raises when no sample of the dataset can be
        used at all."""
        ds = self.ds
        total = int(ds._counts.sum())
        for step in range(1, total + 1):
            i = (after + step) % total
            try:
                if ds._lmdb is None:
                    shard, start, end = (int(x[0]) for x in ranges.bounds(np.array([i]), ds._first, ds._offsets))
                    read_at = buffer_reader(reader.read(shard, start, end), start)
                    sample = decode(_parse((end, read_at), ds.urls[shard], start))
                else:
                    sample = decode(_from_lmdb(next(self._lmdb_reads(np.array([i])))[2], ds.urls[0], i))
            except CorruptShardError:  # unusable too: try the next one
                continue
            except ShardkitError:  # storage that fails is not bad data
                raise
            except Exception:  # noqa: BLE001 - undecodable: the next one
                continue
            try:
                return transform(sample) if transform is not None else sample  # user code: its errors are its own
            except FieldError:  # but bad data it found is bad data
                continue
        raise CorruptShardError(f"{ds.urls[0]} and the other {len(ds.urls) - 1} shards: no sample could be used")

    def _reads(self, ids: np.ndarray, reader: storage.RangeReader) -> Iterator[Read]:
        """(shard, start, (stop, read_at)) for each sample of `ids`, in order, its range read
        ahead: `read_at` reads the sample's bytes from the local file, or from the range held
        in memory. In place of (stop, read_at), the error of a range that could not be read."""
        ds = self.ds
        shard_of, starts, ends = ranges.bounds(ids, ds._first, ds._offsets)
        local = all(map(storage.is_local, ds.urls))  # one remote shard: its ranges go through the budget
        if local:
            plan, range_of = ranges.coalesce(shard_of, starts, ends, max_bytes=16 << 20)
        else:  # a block's samples come within block + 2 windows of each other: further apart, a new use,
            # read again rather than held, unless the whole dataset fits in the read-ahead budget
            gap = None if ds.index.bytes <= ds.prefetch_bytes else ds.block + 2 * self.window
            plan, range_of = ranges.blocks(ids, ds._first, ds._offsets, ds.block, gap)

        def fetch(r: ranges.Range) -> ReadAt | CorruptShardError:
            try:
                if reader.is_local(r.shard):  # the kernel reads the range ahead; samples come straight from the file
                    reader.advise(r.shard, r.start, r.stop)
                    return reader.read_at(r.shard)
                return buffer_reader(reader.read(r.shard, r.start, r.stop, partial=True), r.start)
            except CorruptShardError as e:  # each sample of the range raises it in turn: skipped or raised
                return e

        self.prefetcher = Prefetcher(plan, fetch, lambda r: r.size,
                                     depth=ds.prefetch, budget=ds.prefetch_bytes, threads=not local)
        fetched = iter(self.prefetcher)
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

    def _lmdb_reads(self, ids: np.ndarray) -> Iterator[Read]:
        """(0, sample id, (key, fields) or the record's error) from the LMDB environment, opened
        in this process. In windows of `LMDB_WINDOW` samples: once a read in a window waited
        for the disk, the rest of that window on `prefetch` threads (formats/lmdb.read_when_cold)."""
        ds = self.ds
        path = ds._lmdb
        assert path is not None
        env = lmdb_format.open_reader(path)

        def read(i: int) -> tuple[str, dict[str, bytes]] | CorruptShardError:
            key = ds._keys[i].decode()
            try:
                return key, lmdb_format.read_one(env, key, path, None if ds._sizes is None else int(ds._sizes[i]))
            except CorruptShardError as e:  # a record missing or resized: skipped or raised, as bad data
                return e

        def touch(i: int) -> None:
            lmdb_format.touch_one(env, ds._keys[i].decode())

        pool: ThreadPoolExecutor | None = None

        def threads() -> ThreadPoolExecutor:
            nonlocal pool
            pool = pool or ThreadPoolExecutor(ds.prefetch, thread_name_prefix="shardkit-lmdb")
            return pool

        when_cold = threads if ds.prefetch > 1 else None
        try:
            for k in range(0, len(ids), LMDB_WINDOW):
                window = ids[k : k + LMDB_WINDOW].tolist()
                for i, sample in zip(window, lmdb_format.read_when_cold(read, touch, window, when_cold)):
                    yield 0, i, sample
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def _from_lmdb(data: tuple[str, dict[str, bytes]], url: str, position: int) -> dict[str, Any]:
    key, fields = data
    return sample_dict(key, url, fields)


class _Where:
    """Names a sample in error messages; formatted only when one is raised."""

    __slots__ = ("url", "start")

    def __init__(self, url: str, start: int):
        self.url, self.start = url, start

    def __str__(self) -> str:
        return f"{storage.display(self.url)} (sample at byte {self.start})"


def _parse(span: tuple[int, ReadAt], url: str, start: int) -> dict[str, Any]:
    stop, read_at = span
    key, fields = read_sample(read_at, start, stop, _Where(url, start))
    return sample_dict(key, url, fields)
