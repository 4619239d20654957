"""One pass of one worker of a StreamingDataset, as stages:

    read ranges -> parse samples -> decode -> transform

The dataset's sample source (samples.py, one per format) reads each planned sample's bytes
in order, ahead of use, and parses one; `_process` takes one sample through parse, decode
and transform, timing each stage; `bad_sample` is the one policy that decides whether a
failure is skipped or raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import ranges, storage
from ..decode import decoder, packed_from
from ..errors import FIND_BAD, SKIP_BAD, CorruptShardError, FieldError, ShardkitError, describe
from ..prefetch import Prefetcher
from ..storage.cache import RangeCache
from .counters import Meter
from .epochs import EpochStream

if TYPE_CHECKING:
    from .dataset import StreamingDataset

log = logging.getLogger("shardkit")
SKIPS_LOGGED = 10  # a worker's first skipped samples are logged (a warning each), the rest only counted

Transform = Callable[[dict[str, Any]], Any]


def bad_sample(e: BaseException, on_error: str, url: str, where: str, in_transform: bool) -> str:
    """The one policy for a sample that failed: returns the line to log when it is skipped,
    raises when it is not, saying how to get past it. Skipped under ``on_error="skip"``: bad
    data only (a corrupt shard, an undecodable field, a FieldError from a transform). Never
    skipped: a failing disk or store, MemoryError, and the transform's own errors."""
    if isinstance(e, MemoryError) or (in_transform and not isinstance(e, FieldError)):
        raise e  # the machine's, or user code's: its errors are its own
    if isinstance(e, ShardkitError) and not isinstance(e, CorruptShardError):
        raise e  # named already; a failing disk or store is never skipped as bad data
    said = str(e) if isinstance(e, CorruptShardError) else f"{storage.display(url)}: {where}: {describe(e)}"
    if on_error == "raise":
        raise CorruptShardError(f"{said}; {SKIP_BAD}; {FIND_BAD}") from e
    return said


class WorkerStream(EpochStream):
    """One pass of one worker of a StreamingDataset: plans, reads, decodes, transforms."""

    ds: StreamingDataset

    def __init__(self, ds: StreamingDataset, rank: int, world: int, worker_id: int, num_workers: int,
                 ids: np.ndarray | None = None, window: int | None = None):
        super().__init__(ds, rank, world, worker_id, num_workers, fixed=ids)
        self.prefetcher: Prefetcher[ranges.Range, Any] | None = None  # set once reading starts
        self.window = window or ds.shuffle_window  # the window that spreads this stream's samples (a mix's)
        self._sample: dict[str, Any] = {}  # the sample being processed, once parsed: named if it fails
        self._in_transform = False  # ...and whether it failed in the user's transform

    def _plan(self) -> np.ndarray:
        planned = super()._plan()  # positions, or a mixture's sample ids
        return planned if self._fixed is not None else self.ds.ids_at(self.epoch, planned)

    def _generate(self) -> Generator[Any, None, None]:
        ds = self.ds
        ids = self._plan()
        cache = RangeCache(ds.cache_dir, ds.cache_limit) if ds.cache_dir is not None else None
        versions = [sh.sha256 for sh in ds.index.shards]
        # the dataset read its index (or scanned its shards) there: the store was reachable
        reader = storage.RangeReader(ds.urls, ds.storage_options, versions, cache, verify=ds.verify, patient=True,
                                     pins=[sh.version for sh in ds.index.shards])
        decode, transform = decoder(ds.decode, ds.backend), ds.transform
        reads, self.prefetcher = ds._samples.reads(ids, reader, ds, self.window)
        meter = Meter(ds._shared, self.worker_id, reader, cache)
        pending = 0  # skipped samples still to be replaced, so the rank's count stays exact
        try:
            for count in range(1, len(ids) + 1):
                shard, start, data = next(reads)
                try:
                    item = self._process(shard, start, data, decode, transform, meter)
                except Exception as e:  # noqa: BLE001 - bad data, reported with the shard and sample named
                    key = self._sample.get("__key__")
                    where = (f"sample {key}" if key is not None else "a sample") + ds._samples.position(start) + \
                        packed_from(self._sample)
                    said = bad_sample(e, ds.on_error, ds.urls[shard], where, self._in_transform)
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
        self._sample, self._in_transform = {}, False
        if isinstance(data, CorruptShardError):
            raise data
        t0 = time.perf_counter()
        sample, size = self.ds._samples.parse(data, self.ds.urls[shard], start)
        t1 = time.perf_counter()
        self._sample = sample
        sample = decode(sample)
        t2 = time.perf_counter()
        self._in_transform = True
        item = transform(sample) if transform is not None else sample
        meter.sample(size, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return item

    def _borrow(self, reader: storage.RangeReader, decode: Callable[[dict[str, Any]], Any],
                transform: Transform | None, after: int) -> Any:
        """The first usable sample after global id `after` (wrapping), standing in for
        skipped samples at the end of a worker's plan, so that the rank's count stays exact
        and a resumed pass picks the same one. Raises when no sample of the dataset can be
        used at all."""
        ds = self.ds
        total = int(ds._counts.sum())
        for step in range(1, total + 1):
            try:
                sample = decode(ds._samples.one((after + step) % total, reader))
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
