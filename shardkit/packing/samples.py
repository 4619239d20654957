"""A pack job's samples: each source item read, checked and optionally re-encoded, in order;
an unusable one as a Skipped (or a SourceError under on_error="fail")."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .. import storage
from ..errors import CorruptShardError, ShardkitError, SourceError, about_the_file, name_file, one_line
from ..formats import gzip
from ..formats import lmdb as lmdb_format
from ..formats.tar import check_key, parse_sample
from ..index import Skipped
from ..sources import shard_problem
from . import executors, images, sidecars
from .executors import tick
from .listing import Item
from .plan import Job, sample_meta

DAMAGED = "source shard "  # how a skip for a converted shard that does not match its index begins
Sample = tuple[str, dict[str, bytes]]  # (key, fields)
REMOTE_READS = 32  # a job's files read at once from a bucket
AHEAD_BYTES = 64 << 20  # at most about this much of a job's source files read ahead of the shard
_UNLIMITED: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()


def _sample(job: Job, item: Item, cores: contextlib.AbstractContextManager[Any] = _UNLIMITED) -> Sample:
    """(key, fields) of one item, read, checked and optionally re-encoded (holding `cores`
    meanwhile): an image with its class, shardkit's record of it and its sidecars and values,
    or a converted sample."""
    if job.source != "folder":
        key, fields = _converted(job, item)
        bad = next(images.bad_images(fields), None) if job.options.decode_check else None
        if bad is not None:
            raise bad[1]
        return key, fields
    data = storage.read_bytes(storage.join(job.src, item.path), job.storage_options)
    opts = job.options
    with cores:
        if opts.resize or opts.quality:
            field, data = "jpg", images.reencode(data, opts.resize, opts.quality or 90)
        else:
            field = images.check(data, images.field_for(item.path) or "", decode=opts.decode_check)
    fields = {field: data, job.meta: sample_meta(item, job.classes)}
    if item.label >= 0:
        fields["cls"] = str(item.label).encode()
    for name, kind, text in sidecars.decode(item.extras):
        fields[name] = _sidecar(job, name, text) if kind == sidecars.FILE else text.encode()
    return item.key, fields


def _sidecar(job: Job, field: str, path: str) -> bytes:
    """A sidecar file's bytes, checked against its field (BadField names the file where
    they do not fit, or it cannot be read)."""
    url = storage.join(job.src, path)
    try:
        data = storage.read_bytes(url, job.storage_options)
    except OSError as e:
        if not about_the_file(e):
            name_file(e, url)
            raise
        raise sidecars.BadField(f"{path}: cannot read ({e.strerror or e})") from None
    sidecars.check(field, data, path)
    return data


def _converted(job: Job, item: Item) -> tuple[str, dict[str, bytes]]:
    """(key, fields) of one sample of the dataset being converted, as its source holds it."""
    if job.source == "tar":
        shard, _, span = item.path.rpartition("@")
        start, stop = (int(x) for x in span.split(":"))
        _check_source_shard(job, shard)
        url = storage.join(job.src, shard)
        data = _source_range(job, shard, start, stop)
        where = f"{url} (sample at byte {start})"
        key, fields = parse_sample(data, where, start)
        try:
            check_key(key)  # another tool's shard may hold what cannot be written back (`.DS_Store`)
        except ValueError as e:
            raise CorruptShardError(f"{where}: {e}") from None
        return key, fields
    if job.source == "lmdb":
        path = storage.local_path(job.src)
        size = item.size if item.size > 0 else None  # the source index's, where it has them
    return item.key, lmdb_format.read_one(lmdb_format.open_reader(path), item.key, path, size)


_source_shards: dict[str, str | None] = {}  # this process's checks in one run: url -> problem
_source_run = ""
_source_streams: dict[str, gzip.Ranges | _Blocks] = {}  # this process's remote or compressed source shard being read
SOURCE_BLOCK = 16 << 20  # bytes a request to a remote source shard asks for


class _Blocks:
    """Ranges of a remote shard, each read from a block of at least SOURCE_BLOCK bytes that
    starts where the range does: a job asks for its samples in order, back to back, so a
    shard costs a request a block, not one a sample (a first byte 50 ms away made that
    ~60 ms a sample)."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int):
        self._fetch, self._size = fetch, size
        self._start, self._data = 0, b""

    def read(self, start: int, stop: int) -> bytes:
        if not self._start <= start <= stop <= self._start + len(self._data):
            self._start, self._data = start, self._fetch(start, min(self._size, max(stop, start + SOURCE_BLOCK)) - start)
        return self._data[start - self._start:stop - self._start]


def _source_range(job: Job, shard: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a source shard: read where it is local, else through blocks of
    it; of the tar inside a compressed one, inflated from where its stream is (a job reads
    its samples in order: one pass a job at most)."""
    url, info = storage.join(job.src, shard), next(info for info in job.shards if info.name == shard)
    if info.compression is None and storage.is_local(url):
        return storage.read_range(url, start, stop, job.storage_options)
    if info.compression is not None and stop - start > gzip.MAX_MEMBER:
        raise CorruptShardError(f"{storage.display(url)} (sample at byte {start}): inflates to {stop - start} bytes, "
                                f"over {gzip.MAX_MEMBER} (a decompression bomb?)")
    if url not in _source_streams:
        _source_streams.clear()

        def fetch(offset: int, n: int) -> bytes:
            end = min(offset + n, info.bytes)
            return storage.read_range(url, offset, end, job.storage_options) if offset < end else b""

        _source_streams[url] = (_Blocks(fetch, info.bytes) if info.compression is None
                                else gzip.Ranges(fetch, storage.display(url), keep=0))
    return _source_streams[url].read(start, stop)


def _check_source_shard(job: Job, shard: str) -> None:
    """Raise CorruptShardError if the shard being converted is not the one its index
    describes (its samples are then skipped, or stop the pack under on_error="fail"), so
    that damage is never copied into shards with fresh checksums. Each process of a run
    reads and hashes a shard whole once, before it copies the shard's first sample. A shard
    that cannot be read at all stops the pack: an outage, not bad data."""
    global _source_run
    if job.run != _source_run:
        _source_shards.clear()
        _source_streams.clear()
        _source_run = job.run
    url = storage.join(job.src, shard)
    if url not in _source_shards:
        info = next(info for info in job.shards if info.name == shard)
        where = storage.display(url)
        try:
            problem = shard_problem(url, info, job.storage_options, parse=False)
        except CorruptShardError as e:
            problem = str(e).removeprefix(f"{where}: ")
        except FileNotFoundError:
            raise SourceError(f"{where}: missing (a shard of the dataset being converted)") from None
        except OSError as e:
            detail = one_line(e) if isinstance(e, ShardkitError) else f"{where}: {e.strerror or e}"
            raise SourceError(f"{detail} (a shard of the dataset being converted)") from None
        _source_shards[url] = problem and f"{DAMAGED}{shard}: {problem}; `shardkit verify` checks them all"
    if _source_shards[url]:
        raise CorruptShardError(str(_source_shards[url]))


def job_samples(job: Job, check: Callable[[str, dict[str, bytes]], None] | None = None) -> Iterator[Sample | Skipped]:
    """The job's samples in order; unusable ones (by `check` too) as Skipped (or SourceError
    under on_error='fail')."""
    pending = 0
    for item, made in _made(job):
        executors.stop_point()
        try:
            sample = made()
            if check is not None:
                check(*sample)
            yield sample
        except (OSError, images.BadImage, CorruptShardError) as e:
            if isinstance(e, OSError) and not about_the_file(e):  # about the machine: stop, naming the file
                name_file(e, storage.join(job.src, item.path))
                raise
            reason = str(e) if isinstance(e, (images.BadImage, CorruptShardError)) else f"cannot read ({e.strerror or e})"
            if job.options.on_error == "fail":
                raise SourceError(f"{storage.join(job.src, item.path)}: {reason}") from None
            yield Skipped(item.path, reason)
        pending += 1
        if pending >= 32:
            tick(pending)
            pending = 0
    tick(pending)


def _made(job: Job) -> Iterator[tuple[Item, Callable[[], Sample]]]:
    """Each item with a call that gives its sample or raises its error, in order. An image
    folder's files are worked on several at a time where that pays: re-encoded or
    decode-checked on the cores a small pack leaves idle (`executors.threads()`; PIL and
    libjpeg-turbo let go of the GIL), read from a bucket REMOTE_READS at a time (its
    first-byte latency hidden) and AHEAD_BYTES ahead at most, decoded there still on no more
    threads than those cores (a camera photo decodes to tens of MB). The same samples, in
    the same order, sooner."""
    opts = job.options
    cores = executors.threads() if (opts.resize or opts.quality or opts.decode_check) else 1
    threads = cores if storage.is_local(job.src) else max(cores, REMOTE_READS)
    if threads <= 1 or job.source != "folder":
        for item in job.items:
            yield item, functools.partial(_sample, job, item)
        return
    limit = threading.BoundedSemaphore(cores) if threads > cores else _UNLIMITED
    pool, stop = ThreadPoolExecutor(threads, thread_name_prefix="shardkit-pack"), threading.Event()
    ahead: deque[tuple[Item, Future[Sample]]] = deque()
    held = 0  # bytes of the source files in `ahead`
    try:
        for item in job.items:
            ahead.append((item, pool.submit(executors.working_for, stop, _sample, job, item, limit)))
            held += item.size
            while len(ahead) >= 2 * threads or held >= AHEAD_BYTES:
                done, future = ahead.popleft()
                held -= done.size
                yield done, future.result
        while ahead:
            done, future = ahead.popleft()
            yield done, future.result
    finally:
        # Closed before its end, the pack given up: what has not started never does, and the
        # reads under way retry no more; nobody waits for them.
        stop.set()
        for _, future in ahead:
            future.cancel()
        pool.shutdown(wait=not ahead)
