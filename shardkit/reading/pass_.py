"""One worker's pass over planned samples, as stages:

    reads (ahead, by the sample source) -> parse -> decode -> transform

A `Pass` is built from a ReadSpec (how to read), a sample source (the format's reads and
parsing, sources/), the sample ids to yield in order, and the worker's slot of the shared
statistics: it never sees the dataset. `bad_sample` is the one policy that decides whether a
failure is skipped or raised; a skipped sample's place is taken by the next good one (or,
at the end of the plan, by a stand-in), so the worker's count stays exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

import numpy as np

from ..order import ranges
from .. import storage
from ..decode import decoder, packed_from
from ..errors import FIND_BAD, SKIP_BAD, CorruptShardError, FieldError, ShardkitError, describe
from .prefetch import Prefetcher
from ..storage.fetch import CONNECTIONS
from .counters import Meter, Slot
from .sources.base import SampleSource
from .spec import ReadSpec, Transform

log = logging.getLogger("shardkit")
SKIPS_LOGGED = 10  # a worker's first skipped samples are logged (a warning each), the rest only counted

Decode = Callable[[dict[str, Any]], Any]


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


class Pass:
    """The samples of `ids` (pieces of global sample ids, in order; a piece is planned and
    read as it comes, so a pass holds one piece's plan at a time), read, decoded and
    transformed as `spec` says. Iterate it once; `window` is the shuffle window that spreads
    the ids (how far apart a block's samples may come, for the read-ahead)."""

    def __init__(
        self,
        spec: ReadSpec,
        source: SampleSource,
        ids: Iterable[np.ndarray],
        slot: Slot,
        window: int,
        connections: int = CONNECTIONS,
    ):
        self.spec, self.source, self.ids, self.slot, self.window = spec, source, ids, slot, window
        self.connections = connections  # this worker's share of its rank's connections (fetch.per_worker)
        self.prefetcher: Prefetcher[ranges.Range, Any] | None = None  # set once reading starts
        self._sample: dict[str, Any] = {}  # the sample being processed, once parsed: named if it fails
        self._in_transform = False  # ...and whether it failed in the user's transform

    def __iter__(self) -> Generator[Any, None, None]:
        return self.samples()

    def samples(self) -> Generator[Any, None, None]:
        """The samples, one by one; closing it ends the pass (its reads, threads and files)."""
        spec, source = self.spec, self.source
        cache = spec.cache()
        reader = spec.reader(cache, self.connections)
        decode = decoder(spec.decode, spec.backend)
        meter = Meter(self.slot, reader, cache)
        pending = 0  # skipped samples still to be replaced, so the rank's count stays exact
        last = -1  # the last id planned, after which a stand-in is looked for
        reads: Generator[Any, None, None] | None = None
        try:
            for ids in self.ids:
                if not len(ids):
                    continue
                reads, self.prefetcher = source.reads(ids, reader, spec, self.window)
                last = int(ids[-1])
                for count in range(1, len(ids) + 1):
                    shard, start, data = next(reads)
                    try:
                        item = self._process(shard, start, data, decode, meter)
                    except Exception as e:  # noqa: BLE001 - bad data, reported with the shard and sample named
                        self._skip(e, shard, start, meter)
                        if spec.global_batches:  # the same stand-in under any layout
                            yield self._borrow(reader, decode, int(ids[count - 1]))
                        else:
                            pending += 1
                        continue
                    for _ in range(pending + 1):
                        yield item
                    pending = 0
                    if count % 256 == 0:
                        meter.flush(self.prefetcher)
                reads.close()
                meter.flush(self.prefetcher)
            if pending:  # bad samples at the end of the plan: a stand-in that a resumed pass picks too
                stand_in = self._borrow(reader, decode, last)
                for _ in range(pending):
                    yield stand_in
        finally:
            if reads is not None:
                reads.close()
            meter.flush(self.prefetcher)
            reader.close()

    def _skip(self, e: Exception, shard: int, start: int, meter: Meter) -> None:
        """Raise `e` as the policy says, or count and log the sample it spoiled."""
        key = self._sample.get("__key__")
        where = (
            (f"sample {key}" if key is not None else "a sample")
            + self.source.position(start)
            + packed_from(self._sample)
        )
        said = bad_sample(e, self.spec.on_error, self.spec.urls[shard], where, self._in_transform)
        meter.skipped()
        if meter.skips <= SKIPS_LOGGED:
            more = " (this worker's further skips are counted in stats() only)" * (meter.skips == SKIPS_LOGGED)
            log.warning("skipped %s%s", said, more)

    def _process(self, shard: int, start: int, data: Any, decode: Decode, meter: Meter) -> Any:
        """One sample through parse -> decode -> transform, each stage timed."""
        self._sample, self._in_transform = {}, False
        if isinstance(data, CorruptShardError):
            raise data
        transform: Transform | None = self.spec.transform
        t0 = time.perf_counter()
        sample, size = self.source.parse(data, self.spec.urls[shard], start)
        t1 = time.perf_counter()
        self._sample = sample
        sample = decode(sample)
        t2 = time.perf_counter()
        self._in_transform = True
        item = transform(sample) if transform is not None else sample
        meter.sample(size, t1 - t0, t2 - t1, time.perf_counter() - t2)
        return item

    def _borrow(self, reader: storage.RangeReader, decode: Decode, after: int) -> Any:
        """The first usable sample after global id `after` (wrapping), standing in for
        skipped samples at the end of a worker's plan, so that the rank's count stays exact
        and a resumed pass picks the same one. Raises when no sample of the dataset can be
        used at all."""
        spec, transform = self.spec, self.spec.transform
        total = spec.order.total
        for step in range(1, total + 1):
            try:
                sample = decode(self.source.one((after + step) % total, reader))
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
        raise CorruptShardError(f"{spec.urls[0]} and the other {len(spec.urls) - 1} shards: no sample could be used")
