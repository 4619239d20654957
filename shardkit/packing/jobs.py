"""A pack job's samples: each source item read, checked and optionally re-encoded, in order;
an unusable one as a Skipped (or a SourceError under on_error="raise")."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

from .. import formats, storage
from ..errors import CorruptShardError, ShardkitError, SourceError, about_the_file, name_file, one_line, shown_name
from ..formats import gzip
from ..formats import lmdb as lmdb_format
from ..formats.tar_sample import parse_sample
from ..formats.tar_writer import check_key
from ..index import Skipped
from ..index.resolve import shard_problem
from ..units import format_size
from . import executors, images, sidecars
from .executors import tick
from .listing import Item
from .inputs import IMAGES
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
    if job.input_kind != IMAGES:
        key, fields = _converted(job, item)
        bad = next(images.bad_images(fields), None) if job.options.decode_check else None
        if bad is not None:
            raise bad[1]
        return key, fields
    opts = job.options
    _check_size(item, opts.max_file_size)
    data = storage.read_bytes(storage.join(job.src, item.path), job.storage_options)
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


def _check_size(item: Item, limit: int | None) -> None:
    """BadImage for a source file larger than `limit` by the listing's size, before any of it
    is read (a 2 GB sparse `.jpg` was read whole, then refused)."""
    if limit is not None and item.size > limit:
        raise images.BadImage(
            f"{format_size(item.size)} ({item.size} bytes), over the limit of "
            f"{format_size(limit)} ({limit} bytes; --max-file-size, max_file_size=): not read"
        )


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
        raise sidecars.BadField(f"{shown_name(path)}: cannot read ({e.strerror or e})") from None
    sidecars.check(field, data, path)
    return data


def _converted(job: Job, item: Item) -> tuple[str, dict[str, bytes]]:
    """(key, fields) of one sample of the dataset being converted, as its source holds it."""
    if formats.get(job.input_kind).sharded:
        shard, _, span = item.path.rpartition("@")
        start, stop = (int(x) for x in span.split(":"))
        _check_source_shard(job, shard)
        data = _source_range(job, shard, start, stop)
        where = f"{storage.join(job.src, shard)} (sample at byte {start})"
        key, fields = parse_sample(data, where, start)
        try:
            check_key(key)  # another tool's shard may hold what cannot be written back (`.DS_Store`)
        except ValueError as e:
            raise CorruptShardError(f"{where}: {e}") from None
        return key, fields
    path = storage.local_path(job.src)  # a keyed database, read from its local copy
    size = item.size if item.size > 0 else None  # the source index's, where it has them
    return item.key, lmdb_format.read_one(lmdb_format.open_reader(path), item.key, path, size)


_source_shards: dict[str, str | None] = {}  # this process's checks in one run: url -> problem
_source_run = ""
_copy: tuple[str, BinaryIO] | None = None  # (url, temporary file) of the remote source shard read now
_inflating: tuple[str, gzip.Ranges] | None = None  # (url, its stream) of the compressed source shard read now


def _source_range(job: Job, shard: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a source shard (its checked copy where it is remote); of the
    tar inside a compressed one, inflated from where its stream is (a job reads its samples
    in order: one pass a job at most)."""
    global _inflating
    url, info = storage.join(job.src, shard), next(info for info in job.shards if info.name == shard)
    if _copy is not None and _copy[0] == url:
        fd = _copy[1].fileno()

        def fetch(offset: int, n: int) -> bytes:
            return os.pread(fd, n, offset)
    else:

        def fetch(offset: int, n: int) -> bytes:
            end = min(offset + n, info.bytes)
            return storage.read_range(url, offset, end, job.storage_options) if offset < end else b""

    if info.compression is None:
        data = fetch(start, stop - start)
        if len(data) != stop - start:
            raise CorruptShardError(
                f"{storage.display(url)}: {len(data)} bytes at offset {start}, expected {stop - start}"
            )
        return data
    if stop - start > gzip.MAX_MEMBER:
        raise CorruptShardError(
            f"{storage.display(url)} (sample at byte {start}): inflates to {stop - start} bytes, "
            f"over {gzip.MAX_MEMBER} (a decompression bomb?)"
        )
    if _inflating is None or _inflating[0] != url:
        _inflating = (url, gzip.Ranges(fetch, storage.display(url), keep=0))
    return _inflating[1].read(start, stop)


def _let_go() -> None:
    """Close this process's copy of a remote source shard and its inflated stream."""
    global _copy, _inflating
    _inflating = None
    if _copy is not None:
        _copy[1].close()
        _copy = None


def _check_source_shard(job: Job, shard: str) -> None:
    """Raise CorruptShardError if the shard being converted is not the one its index
    describes (its samples are then skipped, or stop the pack under on_error="raise"), so
    that damage is never copied into shards with fresh checksums. Each process of a run
    reads and hashes a shard whole once, before it copies the shard's first sample; a remote
    one is downloaded into a temporary file as it is hashed, and its samples read from there
    (one download, not one to check and one to copy). A shard that cannot be read at all
    stops the pack: an outage, not bad data."""
    global _source_run, _copy
    if job.run != _source_run:
        _source_shards.clear()
        _let_go()
        _source_run = job.run
    url = storage.join(job.src, shard)
    if url in _source_shards:
        if _source_shards[url]:
            raise CorruptShardError(str(_source_shards[url]))
        if storage.is_local(url) or (_copy is not None and _copy[0] == url):
            return  # checked, and at hand (a remote one's copy let go: downloaded again)
    _let_go()
    copy = None if storage.is_local(url) else _temporary_file(url)
    try:
        problem = _source_problem(job, shard, None if copy is None else functools.partial(_copied, copy, url))
    except BaseException:
        if copy is not None:
            copy.close()
        raise
    _source_shards[url] = problem and f"{DAMAGED}{shard}: {problem}; `shardkit verify` checks them all"
    if copy is not None and not problem:
        copy.flush()
        _copy = (url, copy)
    elif copy is not None:
        copy.close()
    if problem:
        raise CorruptShardError(str(_source_shards[url]))


def _temporary_file(url: str) -> BinaryIO:
    try:
        return tempfile.TemporaryFile(prefix="shardkit-source-")
    except OSError as e:
        raise _no_room(url, e) from None


def _copied(copy: BinaryIO, url: str, data: bytes) -> None:
    """Write a piece of a remote source shard into its copy as it comes (or end there, the
    pack given up)."""
    executors.stop_point()
    try:
        copy.write(data)
    except OSError as e:
        raise _no_room(url, e) from None


def _no_room(url: str, e: OSError) -> ShardkitError:
    """Not the source's fault: a local disk that cannot hold its copy stops the pack."""
    return ShardkitError(
        f"{tempfile.gettempdir()}: cannot hold a copy of {storage.display(url)} "
        f"({e.strerror or e}); set TMPDIR to a folder with room for a source shard"
    )


def _source_problem(job: Job, shard: str, copy_to: Callable[[bytes], None] | None) -> str | None:
    """How a source shard differs from its index entry (None: it does not), read whole (and
    handed to `copy_to`, if given); SourceError if it cannot be read."""
    url = storage.join(job.src, shard)
    info = next(info for info in job.shards if info.name == shard)
    where = storage.display(url)
    try:
        return shard_problem(url, info, job.storage_options, parse=False, copy_to=copy_to)
    except CorruptShardError as e:
        return str(e).removeprefix(f"{where}: ")
    except FileNotFoundError:
        raise SourceError(f"{where}: missing (a shard of the dataset being converted)") from None
    except OSError as e:
        detail = one_line(e) if isinstance(e, ShardkitError) else f"{where}: {e.strerror or e}"
        raise SourceError(f"{detail} (a shard of the dataset being converted)") from None


def job_samples(job: Job, check: Callable[[str, dict[str, bytes]], None] | None = None) -> Iterator[Sample | Skipped]:
    """The job's samples in order; unusable ones (by `check` too) as Skipped (or SourceError
    under on_error='raise'). This process's copy of a remote source shard is kept after the
    job only where the next job goes on in that shard."""
    pending, finished = 0, False
    try:
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
                reason = (
                    str(e)
                    if isinstance(e, (images.BadImage, CorruptShardError))
                    else f"cannot read ({e.strerror or e})"
                )
                if job.options.on_error == "raise":
                    raise SourceError(f"{shown_name(storage.join(job.src, item.path))}: {reason}") from None
                yield Skipped(item.path, reason)
            pending += 1
            if pending >= 32:
                tick(pending)
                pending = 0
        finished = True
    finally:
        if not (finished and job.source_goes_on):
            _let_go()
    tick(pending)


def _one() -> int:
    return 1


class _Cores:
    """A job's hold on the cores it may keep busy, `allowed()` of them: a thread takes one
    for its CPU work, waiting while all are taken (`allowed()` rises as the run's other
    jobs end, so it is asked again every 50 ms)."""

    def __init__(self, allowed: Callable[[], int]):
        self._allowed, self._busy, self._turn = allowed, 0, threading.Condition()

    def __enter__(self) -> None:
        with self._turn:
            while self._busy >= self._allowed():
                self._turn.wait(0.05)
            self._busy += 1

    def __exit__(self, *exc: object) -> None:
        with self._turn:
            self._busy -= 1
            self._turn.notify()


def _made(job: Job) -> Iterator[tuple[Item, Callable[[], Sample]]]:
    """Each item with a call that gives its sample or raises its error, in order. An image
    folder's files are worked on several at a time where that pays: re-encoded or
    decode-checked on as many cores as the run lends this job now (`executors.threads()`:
    more than one once other jobs are done; PIL and libjpeg-turbo let go of the GIL), read
    from a bucket REMOTE_READS at a time (its first-byte latency hidden) and AHEAD_BYTES
    ahead at most, decoded there still on no more threads than those cores (a camera photo
    decodes to tens of MB). The same samples, in the same order, sooner."""
    if job.input_kind != IMAGES:  # a converted shard is read front to back, one sample at a time
        for item in job.items:
            yield item, functools.partial(_sample, job, item)
        return
    opts = job.options
    heavy = bool(opts.resize or opts.quality or opts.decode_check)
    cores = executors.threads if heavy else _one
    first = 0  # the first item for threads
    local = storage.is_local(job.src)
    if local:  # one at a time, no threads, until cores are lent (on one core their hand-offs cost 6%)
        lendable = heavy and executors.most_threads() > 1
        while first < len(job.items) and not (lendable and cores() > 1):
            yield job.items[first], functools.partial(_sample, job, job.items[first])
            first += 1
        if first == len(job.items):
            return
    # from a bucket: REMOTE_READS reads at once, the cores' work on as many of them as lent
    threads = executors.most_threads() if local else max(cores(), REMOTE_READS)
    limit = _Cores(cores)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="shardkit-pack")
    stop = threading.Event()
    ahead: deque[tuple[Item, Future[Sample]]] = deque()
    held = 0  # bytes of the source files in `ahead`
    try:
        for item in job.items[first:]:
            ahead.append((item, pool.submit(executors.working_for, stop, _sample, job, item, limit)))
            held += item.size
            while len(ahead) >= 2 * (cores() if local else threads) or held >= AHEAD_BYTES:
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
