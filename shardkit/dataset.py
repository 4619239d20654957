"""StreamingDataset: a torch IterableDataset over shards, split across DDP ranks and
DataLoader workers, every rank yielding exactly the same number of samples.

The dataset object is cheap to build and to pickle: it holds the index as numpy arrays.
Everything else (open files, the worker's plan) is made inside `__iter__`, in the worker.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from . import checks, partition, ranges, storage
from .cache import RangeCache
from .counters import Meter
from .decode import decoder, sample_dict
from .epochs import EpochDataset, EpochStream
from .errors import CorruptShardError, FieldError, ShardkitError, describe
from .formats import lmdb as lmdb_format
from .formats.tar import ReadAt, buffer_reader, read_sample
from .prefetch import Prefetcher
from .sources import local_lmdb, resolve
from .storage import StorageOptions


log = logging.getLogger("shardkit")
SKIPS_LOGGED = 10  # a worker's first skipped samples are logged (a warning each), the rest only counted
LMDB_WINDOW = 64  # samples of an LMDB dataset that one read from the disk sends to the threads


class StreamingDataset(EpochDataset):
    """Stream samples from tar shards (a dataset folder with index.json, a brace pattern
    such as ``shards-{000000..000009}.tar``, or a list of shard paths or URLs).

    Yields WebDataset-style dicts: ``__key__``, ``__url__`` and one entry per field,
    images decoded as `decode` says ("raw" bytes, "pil", "rgb8" HWC uint8 numpy, "tensor"
    CHW uint8 torch), ``cls`` as int, ``json`` as dict. `transform(sample)` runs in the
    worker and its result is what the DataLoader receives.

    Every rank yields ``len(ds)`` samples per epoch. With ``remainder="repeat"`` (default)
    the last few samples that don't divide evenly are topped up by repeating samples from
    the start of the epoch's order, so none is ever left out; ``"drop"`` leaves a few out.
    With ``shuffle=True`` the order depends only on (seed, epoch) and the layout (world size,
    num_workers); call ``set_epoch`` each epoch, or let each pass advance the epoch by one.

    ``batch_size=B`` makes each worker yield whole batches, collated as ``default_collate``
    would but straight into reused shared memory (see batching.py): use it with
    ``DataLoader(ds, batch_size=None)``. ``len(ds)`` then counts batches, at most one of them
    short per rank.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        decode: str = "raw",
        transform: Callable[[dict[str, Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        remainder: str = "repeat",
        shuffle_window: int = 1024,
        block: int = 64,
        on_error: str = "raise",
        verify: bool = False,
        prefetch: int = 8,
        prefetch_bytes: int | str = "256MB",
        cache_dir: str | None = None,
        cache_limit: int | str = "20GB",
        storage_options: StorageOptions | None = None,
        batch_size: int | None = None,
    ):
        super().__init__(rank, world_size, shuffle=shuffle, seed=seed, shuffle_window=shuffle_window,
                         remainder=remainder, batch_size=batch_size)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        self.block, self.prefetch = checks.integer("block", block, 1), checks.integer("prefetch", prefetch)
        decoder(decode)  # validate early, in the main process
        self.urls, self.index = resolve(source, checks.mapping("storage_options", storage_options))
        self.decode, self.transform, self.on_error = decode, checks.function("transform", transform), on_error
        self.storage_options, self.verify = storage_options, checks.flag("verify", verify)
        self.prefetch_bytes = checks.size("prefetch_bytes", prefetch_bytes, 1)
        self.cache_dir, self.cache_limit = cache_dir, checks.size("cache_limit", cache_limit, 1)
        if cache_dir is not None and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
            raise ValueError(f"cache_dir {cache_dir!r} is a file, not a folder")
        if cache_dir is not None and self.cache_limit < self.prefetch_bytes:
            raise ValueError(
                f"cache_limit ({self.cache_limit} bytes) is smaller than the read-ahead budget prefetch_bytes "
                f"({self.prefetch_bytes} bytes): raise cache_limit or lower prefetch_bytes"
            )
        counts = np.array([s.samples for s in self.index.shards], dtype=np.int64)
        self._counts = counts
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._lmdb: str | None = None  # local path of an LMDB dataset
        self._keys, self._sizes = np.empty(0, dtype="S1"), None  # an LMDB's, sizes checked at each read
        if self.index.kind == "lmdb":
            self._lmdb = local_lmdb(self.urls[0], storage_options, cache_dir, self.cache_limit)
            self._keys, self._sizes = lmdb_format.sample_tables(self.index.extra)
            self._offsets = np.empty(0, np.int64)
        else:
            tables = [s.offsets for s in self.index.shards]
            if any(t is None for t in tables):
                raise ShardkitError(f"{source!r}: index lacks sample offsets; rebuild it with `shardkit index`")
            self._offsets = np.concatenate([np.asarray(t, dtype=np.int64) for t in tables] or [np.empty(0, np.int64)])
        self.index = self.index.slim()  # the per-sample tables live on in the arrays above only

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    @staticmethod
    def mix(parts: Sequence[tuple[str | Sequence[str] | StreamingDataset, float]], **options: Any) -> Any:
        """Several datasets drawn by weight: `StreamingDataset.mix([("s3://a", 0.7), ("s3://b", 0.3)],
        shuffle=True)`. Options: samples_per_epoch (default: all samples together), shuffle,
        seed, shuffle_window, remainder, rank, world_size, batch_size (batches of the mixture,
        as StreamingDataset's), and any StreamingDataset option for the parts given as URLs.
        See shardkit/mix.py for the epoch semantics."""
        from .mix import MixedDataset

        return MixedDataset(parts, **options)

    def _total(self) -> int:
        return int(self._counts.sum())

    def _order(self) -> dict[str, Any]:
        if not self.shuffle:
            return super()._order()
        # the shuffled order goes shard by shard: the same samples cut into other shards are another order
        digest = hashlib.sha256(np.asarray(self._counts, dtype="<i8").tobytes()).hexdigest()[:12]
        return {**super()._order(), "block": self.block, "shard_sizes": f"{len(self._counts)} shards, sha256 {digest}"}

    def _sequence(self, epoch: int) -> np.ndarray:
        return partition.global_sequence(self._counts, seed=self.seed, epoch=epoch, shuffle=self.shuffle, block=self.block)

    def __iter__(self) -> Iterator[Any]:
        return self._stream(_WorkerStream(self, *self._layout()))


class _WorkerStream(EpochStream):
    """One pass of one worker of a StreamingDataset: plans, reads, decodes, transforms."""

    ds: StreamingDataset

    def __init__(self, ds: StreamingDataset, rank: int, world: int, worker_id: int, num_workers: int,
                 ids: np.ndarray | None = None, window: int | None = None):
        super().__init__(ds, rank, world, worker_id, num_workers, fixed=ids)
        self.prefetcher: Prefetcher[ranges.Range, Any] | None = None  # set once reading starts
        self.window = window or ds.shuffle_window  # the window that spreads this stream's samples (a mix's)

    def _borrow(self, reader: storage.RangeReader, decode: Callable[[dict[str, Any]], Any],
                transform: Callable[[dict[str, Any]], Any] | None, after: int) -> Any:
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

    def _lmdb_reads(self, ids: np.ndarray
                    ) -> Iterator[tuple[int, int, tuple[str, dict[str, bytes]] | CorruptShardError]]:
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

    def _reads(self, ids: np.ndarray, reader: storage.RangeReader
               ) -> Iterator[tuple[int, int, tuple[int, ReadAt] | CorruptShardError]]:
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

    def _generate(self) -> Iterator[Any]:
        ds = self.ds
        ids = self._plan()
        cache = RangeCache(ds.cache_dir, ds.cache_limit) if ds.cache_dir is not None else None
        versions = [sh.sha256 for sh in ds.index.shards]
        # the dataset read its index (or scanned its shards) there: the store was reachable
        reader = storage.RangeReader(ds.urls, ds.storage_options, versions, cache, verify=ds.verify, patient=True)
        decode = decoder(ds.decode)
        transform = ds.transform
        pending = 0  # skipped samples still to be replaced, so the rank's count stays exact
        skipped = 0
        reads: Iterator[tuple[int, int, Any]]
        if ds._lmdb is None:
            reads, parse = self._reads(ids, reader), _parse
        else:
            reads, parse = self._lmdb_reads(ids), _from_lmdb

        meter = Meter(ds._shared, self.worker_id, reader, cache)
        try:
            for count in range(1, len(ids) + 1):
                t0 = time.perf_counter()
                shard, start, data = next(reads)
                url = ds.urls[shard]
                sample = None
                transforming = False
                try:
                    if isinstance(data, CorruptShardError):
                        raise data
                    sample = parse(data, url, start)  # a local sample's bytes are read here
                    t1 = time.perf_counter()
                    size = data[0] - start if ds._lmdb is None else sum(map(len, data[1].values()))
                    sample = decode(sample)
                    t2 = time.perf_counter()
                    transforming = True
                    item = transform(sample) if transform is not None else sample
                except Exception as e:  # noqa: BLE001 - bad data, reported with the shard and sample named
                    if isinstance(e, MemoryError) or (transforming and not isinstance(e, FieldError)):
                        raise  # the machine's, or user code's: its errors are its own
                    if isinstance(e, ShardkitError) and (ds.on_error == "raise" or not isinstance(e, CorruptShardError)):
                        raise  # named already; a failing disk or store is never skipped as bad data
                    if isinstance(e, CorruptShardError):
                        said = str(e)
                    else:
                        where = f"sample {sample['__key__']}" if sample is not None else "a sample"
                        where += f" at byte {start}" if ds._lmdb is None else ""
                        said = f"{storage.display(url)}: {where}: {describe(e)}"
                    if ds.on_error == "raise":
                        raise CorruptShardError(said) from e
                    meter.values[5] += 1
                    pending += 1
                    skipped += 1
                    if skipped <= SKIPS_LOGGED:
                        more = " (this worker's further skips are counted in stats() only)" * (skipped == SKIPS_LOGGED)
                        log.warning("skipped %s%s", said, more)
                    continue
                t3 = time.perf_counter()
                stats = meter.values
                stats[0] += 1
                stats[1] += size
                stats[2] += t1 - t0
                stats[3] += t2 - t1
                stats[4] += t3 - t2
                for _ in range(pending):
                    yield item
                pending = 0
                yield item
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
