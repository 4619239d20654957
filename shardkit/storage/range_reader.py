"""RangeReader: a worker's reads of byte ranges of its shards, local or remote, with the
optional block cache, checksum checks and version pinning."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import threading
from typing import TYPE_CHECKING, Any

from ..errors import AccessDeniedError, CorruptShardError, NotFoundError, ShardkitError, one_line
from . import fingerprint
from .descriptors import FILES
from .fetch import CONNECTIONS, FetchEngine
from .files import pin_of
from .patience import patience_for
from .retry import retrying, root_cause, status_of
from .stores import Store, store_for
from .streams import BUFFERS, Arriving, Piece, ReadAt
from .urls import StorageOptions, display, is_local, local_path

if TYPE_CHECKING:
    from .cache import RangeCache


_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)  # posix_fadvise: Linux and BSDs, not macOS
_READERS = itertools.count()  # a number for each reader: its local files' keys in FILES


class RangeReader:
    """Byte ranges of a fixed list of shards, thread-safe.

    Local files are read with pread, straight into the caller's bytes (`read_at`), and
    `advise` starts the disk read-ahead of a range before it is needed; their descriptors
    are the process's bounded set (descriptors.FILES), opened again when needed. A remote
    shard is read through its store (stores/, one a shard): ranged GETs retried on transient
    errors (`patient`: for as long as an outage of the store may last, see patience.py),
    resumed from where their bytes stopped, through the optional local cache; `stream`
    hands a range's bytes over as they arrive. `versions` are the shards' sha256s; `pins`
    their versions (index.ShardInfo.version): a conditional store's reads carry the pin
    (S3's If-Match), other shards are checked when first opened, and a shard replaced since
    raises CorruptShardError naming it. `throttled` counts the store's 503/429s.
    """

    def __init__(
        self,
        urls: list[str],
        storage_options: StorageOptions | None = None,
        versions: list[str | None] | None = None,
        cache: RangeCache | None = None,
        verify: bool = False,
        patient: bool = False,
        pins: list[dict[str, Any] | None] | None = None,
        connections: int = CONNECTIONS,
    ):
        self._urls = urls
        self._pins = pins or [None] * len(urls)
        self._patient = patient  # the caller has reached the store: reads ride out an outage
        self._opts = storage_options
        self._versions = versions or [None] * len(urls)
        self._cache = cache
        self._verify = verify
        self._local = [is_local(u) for u in urls]
        self._handles: dict[int, Any] = {}  # shard -> its key in FILES (local), or its Store
        self._number = next(_READERS)
        self._instances: dict[tuple[Any, ...], Any] = {}
        self._bad: dict[int, ShardkitError] = {}
        self._opening: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()  # held for moments only: never across a read or a hash
        self._closed = False
        self.fetched_bytes = 0  # downloaded from remote storage, sha256 checks included (cache hits excluded)
        self.throttled = 0  # answers of the store asking for fewer requests (503 SlowDown, 429)
        self.engine = FetchEngine(connections)  # pieces and hedges of the remote ranges (fetch.py)
        self.engine.throttled = self._throttle
        self._pid = os.getpid()  # a reader inherited by a forked child is not one of the child's
        BUFFERS.opening()  # the process's buffers are kept while a reader is open

    def _handle(self, shard: int) -> Any:
        handle = self._handles.get(shard)
        if handle is not None:
            return handle
        with self._lock:
            self._check_open()
            opening = self._opening.setdefault(shard, threading.Lock())
        with opening:  # one opener per shard; other shards open (and hash) meanwhile
            if shard in self._bad:
                raise self._bad[shard]
            handle = self._handles.get(shard)
            if handle is not None:
                return handle
            try:
                handle = self._open(shard)
            except ShardkitError as e:
                self._bad[shard] = e  # hash (or fail to) once, not once per read in flight
                raise
            with self._lock:
                if self._closed:  # closed while this shard was opening
                    if self._local[shard]:
                        os.close(handle)
                    self._check_open()
                if self._local[shard]:
                    FILES.adopt((self._number, shard), handle)
                    handle = (self._number, shard)
                self._handles[shard] = handle
        return handle

    def _open_local(self, shard: int) -> int:
        try:
            return os.open(local_path(self._urls[shard]), os.O_RDONLY)
        except OSError as e:
            kind = {FileNotFoundError: NotFoundError, PermissionError: AccessDeniedError}.get(type(e), ShardkitError)
            raise kind(f"{display(self._urls[shard])}: {type(e).__name__}: {one_line(e)}") from e

    def _open(self, shard: int) -> Any:
        handle: Any
        if self._local[shard]:
            handle = self._open_local(shard)
        else:
            handle = store_for(self._urls[shard], self._opts, patient=self._patient, instances=self._instances)
        try:
            self._check_pin(shard, handle)
            if self._verify:
                self._check_sha256(shard, handle)
        except ShardkitError:
            if self._local[shard]:
                os.close(handle)
            raise
        return handle

    def _check_pin(self, shard: int, handle: Any) -> None:
        """Check a shard's pin against the index's as it is opened: its fingerprint (one
        read of its first block: local shards, and stores that keep no version), or its store's
        version; a conditional store's reads check that themselves (If-Match), at no extra
        request."""
        expected, url = self._pins[shard], self._urls[shard]
        if expected is None:
            return
        if fingerprint.MARK in expected:
            if self._verify and self._versions[shard] is not None:
                return  # the whole shard's sha256 is checked next
            why = self._fingerprint(shard, handle, str(expected[fingerprint.MARK]))
            if why is not None:
                raise self._replaced(shard, why)
            return
        if self._local[shard] or handle.conditional:
            return
        found = pin_of(url, handle.info(url, " (version)"))
        if found is not None and found.keys() == expected.keys() and found != expected:
            mark = next(iter(expected))
            raise self._replaced(shard, f"{mark} {found[mark]}, the index has {expected[mark]}")

    def _fingerprint(self, shard: int, handle: Any, expected: str) -> str | None:
        """How the shard differs from its fingerprint (fingerprint.mismatch), read through its
        descriptor or its store's ranged GETs."""
        if self._local[shard]:
            try:
                return fingerprint.mismatch(expected, os.fstat(handle).st_size, fingerprint.read_descriptor(handle))
            except OSError as e:
                raise ShardkitError(
                    f"{display(self._urls[shard])}: reading bytes 0-{fingerprint.HEAD}: "
                    f"{type(e).__name__}: {one_line(e)}"
                ) from e
        store, url = handle, self._urls[shard]

        def read(start: int, stop: int) -> tuple[bytes, int | None]:
            into = Arriving(start, stop)
            try:
                size = store.get(url, start, stop, into, None)
            except Exception as e:
                if status_of(root_cause(e)) != 416:  # 416: the object ends before `start` (an emptied shard)
                    raise
                return b"", None
            into.finish()
            data = into.data()
            into.release()
            return data, size

        def remote() -> str | None:  # one ranged GET: the size comes with it where the answer tells it
            head, size = read(0, fingerprint.HEAD)
            if size is None:
                size = store.size_now(url)
            return fingerprint.mismatch(expected, size, lambda start, stop: head[start:stop])

        found: str | None = handle.retried_get(url, " (fingerprint)", remote, throttled=self._throttle)
        return found

    def _replaced(self, shard: int, how: str) -> CorruptShardError:
        return CorruptShardError(
            f"{display(self._urls[shard])}: changed since its index was made ({how}): a replaced "
            "shard needs its index rebuilt (`shardkit index --force`), a copied dataset its "
            "versions recorded anew (`shardkit index --versions`)"
        )

    def _fetched(self, n: int) -> None:
        with self._lock:
            self.fetched_bytes += n

    def _throttle(self) -> None:
        with self._lock:
            self.throttled += 1

    def _check_sha256(self, shard: int, handle: Any) -> None:
        """Hash the whole shard once (the first time this reader touches it) against the
        index; a close() stops it at its next chunk."""
        expected, url = self._versions[shard], self._urls[shard]
        if expected is None:
            return

        def digest() -> str:
            sha, done = hashlib.sha256(), 0
            f = None if self._local[shard] else handle.open(url, " (sha256 check)")
            try:
                while True:
                    self._check_open()  # a close() stops the hash at its next chunk
                    chunk = os.pread(handle, 8 << 20, done) if f is None else f.read(8 << 20)
                    if not chunk:
                        return sha.hexdigest()
                    sha.update(chunk)
                    done += len(chunk)
            finally:
                if f is not None:
                    f.close()
                    with self._lock:
                        self.fetched_bytes += done

        wait = patience_for(url, self._opts)
        if (
            retrying(f"{display(url)} (sha256 check)", digest, wait.attempts(self._patient), stalls=wait.stalls)
            != expected
        ):
            raise CorruptShardError(f"{display(url)}: sha256 mismatch with the index (shard changed or corrupt)")

    def _check_open(self) -> None:
        """Fail a read, or a retry of one, that comes after close(): a `break` out of the
        loop stops read-ahead threads from going on at the store."""
        if self._closed:
            raise ShardkitError("read after the reader was closed")

    def is_local(self, shard: int) -> bool:
        return self._local[shard]

    def read_at(self, shard: int) -> ReadAt:
        """`read_at(size, offset)` on a local shard, valid until close(): fewer bytes only
        where the file ends (a short read mid-file, as FUSE and NFS mounts may give, is
        continued). An I/O error is a ShardkitError naming the shard: not bad data."""
        if not self._local[shard]:
            raise ValueError(f"{display(self._urls[shard])}: a remote shard is read by range, not read_at")
        key, url = self._handle(shard), self._urls[shard]

        def reopen() -> int:
            return self._open_local(shard)

        def read_at(size: int, offset: int) -> bytes:
            if self._closed:  # _check_open, inlined: this runs for every member of every sample
                raise ShardkitError("read after the reader was closed")
            fd = FILES.acquire(key, reopen)
            try:
                data = os.pread(fd, size, offset)
                while 0 < len(data) < size and (more := os.pread(fd, size - len(data), offset + len(data))):
                    data += more
            except OSError as e:
                raise ShardkitError(
                    f"{display(url)}: reading bytes {offset}-{offset + size}: {type(e).__name__}: {one_line(e)}"
                ) from e
            finally:
                FILES.release(fd)
            return data

        return read_at

    def advise(self, shard: int, start: int, stop: int) -> None:
        """Ask the kernel to start reading bytes [start, stop) of a local shard into the page
        cache, and return. A hint: where it cannot be given (macOS), nothing."""
        if self._local[shard] and stop > start and _WILLNEED is not None:
            fd = FILES.acquire(self._handle(shard), lambda: self._open_local(shard))
            try:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, start, stop - start, _WILLNEED)
            finally:
                FILES.release(fd)

    def read(self, shard: int, start: int, stop: int, partial: bool = False) -> bytes:
        """Bytes [start, stop) of a shard. A shard that ends before `stop` (truncated or
        replaced) raises CorruptShardError, or with `partial` gives the bytes up to its end,
        for the caller to tell which samples are whole."""
        if self._local[shard]:
            data = self.read_at(shard)(stop - start, start)
        else:
            arrived = Arriving(start, stop)
            self._fill(shard, start, stop, arrived)
            data = arrived.data()
            arrived.release()
        if len(data) < stop - start and not partial:
            raise self._short(shard, start, stop, len(data))
        return data

    def stream(self, shard: int, start: int, stop: int, into: Arriving) -> None:
        """Fill `into` with bytes [start, stop) of a remote shard as they arrive, then finish
        it: at the shard's end if it ends before `stop`, or with the error that stopped the
        read. A retry asks for the rest only; a conditional store reads only the version the
        index pinned."""
        try:
            if self._local[shard]:  # a local shard among remote ones: read at once
                into.adopt(self.read(shard, start, stop, partial=True))
                return
            self._fill(shard, start, stop, into)
        except BaseException as e:  # noqa: BLE001 - the consumer raises it, at the first sample it concerns
            into.finish(error=e)

    def _fill(self, shard: int, start: int, stop: int, into: Arriving) -> None:
        url, version = self._urls[shard], self._versions[shard]
        cache = self._cache if version is not None else None  # without a sha256, a replaced shard looks the same
        cached = cache.get(url, version, start, stop) if cache is not None else None
        if cached is not None:
            into.adopt(cached)
            return
        store: Store = self._handle(shard)
        pin = self._pins[shard]
        bounds = self.engine.bounds(start, stop, self.throttled)
        pieces = into.split(bounds) if len(bounds) > 2 else into.pieces

        def get(piece: Piece) -> None:
            self._check_open()
            at, size = piece.lo + piece.filled, None
            try:
                size = self.engine.get(store, url, piece, pin)
            except Exception as e:
                status = status_of(root_cause(e))
                if status == 412:
                    raise self._replaced(shard, _no_longer(pin)) from None
                if status != 416:  # 416: the object ends before `at`
                    raise
                size = at
            if piece.lo + piece.filled < piece.hi:
                if size is None:  # an answer that did not tell
                    size = store.size_now(url)
                if size >= piece.hi:  # a cut-short body: the rest
                    raise OSError(f"short read: {piece.filled} of {piece.hi - piece.lo} bytes")
                # else the object does end there

        def fetch(piece: Piece) -> None:
            store.retried_get(url, f" (bytes {start}-{stop})", functools.partial(get, piece), throttled=self._throttle)

        into.counted = self._fetched  # counted as they come: a pass that ends at its last byte has them all
        self.engine.run(pieces, fetch)
        if cache is not None and into.filled == stop - start:  # its readers have every byte already
            cache.put(url, version, start, stop, into.data())
        into.finish(end=start + into.filled)  # after it, a released buffer is reused

    def _short(self, shard: int, start: int, stop: int, got: int) -> CorruptShardError:
        return CorruptShardError(
            f"{display(self._urls[shard])}: {got} bytes at offset {start}, the index expects {stop - start} "
            "(shard truncated or replaced)"
        )

    def close(self) -> None:
        """Close the files. Reads still running on read-ahead threads fail cleanly after this."""
        with self._lock:
            was, self._closed = self._closed, True
            self._handles.clear()
        FILES.forget(self._number)
        if not was and self._pid == os.getpid():
            BUFFERS.closing()
        self.engine.close()


def _no_longer(pin: dict[str, Any] | None) -> str:
    """What a conditional read found changed: the pin's mark (S3's ETag, GCS's generation)."""
    mark, value = next(iter((pin or {"etag": None}).items()))
    return f"its {_MARKS.get(mark, mark)} is no longer {value}"


_MARKS = {"etag": "ETag"}
