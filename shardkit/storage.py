"""The only module that talks to storage. Local paths take a direct os path (fast, no
fsspec overhead); everything else goes through fsspec with the caller's storage options
passed through unchanged."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar


from .errors import CorruptShardError, ShardkitError, one_line, redact
from .seqwrite import SequentialWriter

if TYPE_CHECKING:
    from .cache import RangeCache
    from .formats.tar import ReadAt

StorageOptions = dict[str, Any]
T = TypeVar("T")

_INSTALL_HINTS = {
    "s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs",
}


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


@functools.lru_cache(maxsize=4096)  # readers name their shard in every sample's error context
def display(url: str) -> str:
    """`url` fit for messages: passwords and presigned-URL signatures replaced by '***'."""
    return redact(url)


def join(base: str, *names: str) -> str:
    """Join path parts with '/', for local paths and URLs alike."""
    out = base.rstrip("/") if base not in ("/", "") else base
    for name in names:
        out = f"{out}/{name}" if out and not out.endswith("/") else f"{out}{name}"
    return out


_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}  # this process's filesystem instances
_GCS = ("gs", "gcs")
REQUEST_TIMEOUT_S = 60  # a connection silent this long fails (and the read is retried)


@functools.cache
def _timeout_adapter() -> Any:
    """A requests transport adapter that gives every request `REQUEST_TIMEOUT_S` unless it
    has a timeout of its own (requests has no default: a stalled connection blocks forever)."""
    import requests.adapters

    class TimeoutAdapter(requests.adapters.HTTPAdapter):
        def send(self, request: Any, **kwargs: Any) -> Any:
            kwargs["timeout"] = kwargs.get("timeout") or REQUEST_TIMEOUT_S
            return super().send(request, **kwargs)

    return TimeoutAdapter


def _time_out(fs: Any) -> None:
    """Give a requests-based filesystem (WebHDFS) a deadline per request."""
    try:
        import requests
    except ImportError:  # then no filesystem in use is built on it
        return
    session = getattr(fs, "session", None)
    if isinstance(session, requests.Session):
        for prefix in ("http://", "https://"):
            session.mount(prefix, _timeout_adapter()())


def filesystem(url: str, storage_options: StorageOptions | None = None,
               instances: dict[tuple[Any, ...], Any] | None = None) -> tuple[Any, str]:
    """(fsspec filesystem, path within it), one instance per process, protocol, host and
    options, kept in `instances` (this module's by default). Missing backends get an
    install hint."""
    import fsspec
    import fsspec.core

    protocol = url.split("://", 1)[0]
    try:
        if "::" in url:  # chained URLs (simplecache::s3://...): let fsspec assemble them
            return fsspec.core.url_to_fs(url, **(storage_options or {}))
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        extra = _INSTALL_HINTS.get(protocol)
        hint = f"pip install 'shardkit[{extra}]'" if extra else f"install the fsspec backend for {protocol}://"
        raise ShardkitError(f"{display(url)}: {protocol}:// support is not installed ({hint})") from e
    except ValueError as e:  # fsspec: "Protocol not known"
        raise ShardkitError(f"{display(url)}: unknown storage protocol {protocol}://") from e
    kwargs = {**cls._get_kwargs_from_urls(url), **(storage_options or {})}
    if protocol in _GCS and "requests_timeout" not in kwargs:  # gcsfs waits forever on a stalled connection
        import aiohttp

        # per socket operation, as for requests: a slow but moving download is not cut off
        kwargs["requests_timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S,
                                                           sock_read=REQUEST_TIMEOUT_S)
    key = (os.getpid(), protocol, json.dumps(kwargs, sort_keys=True, default=repr))
    cache = _FILESYSTEMS if instances is None else instances
    fs = cache.get(key)
    if fs is None:
        fs = cls(**kwargs)
        _time_out(fs)
        fs = cache.setdefault(key, fs)
    return fs, cls._strip_protocol(url)


_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)  # posix_fadvise: Linux and BSDs, not macOS

# Errors that another attempt cannot fix; everything else remote (resets, 5xx, timeouts,
# truncated responses) is retried.
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ShardkitError)
RETRIES = 5


def retrying(what: str, fn: Callable[[], T], attempts: int = RETRIES, base_s: float = 0.2, cap_s: float = 10.0) -> T:
    """Call `fn`, retrying transient failures with exponential backoff and full jitter; then
    fail with one line naming `what` (a URL: never the storage options)."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except _PERMANENT as e:
            named = _naming(e, what)
            if named is e:
                raise
            raise named from e
        except Exception as e:  # noqa: BLE001 - the remote client's errors have no common base
            if type(e) is OSError and str(e).startswith("Forbidden"):  # gcsfs's HTTP 403: permanent
                raise PermissionError(f"{what}: {one_line(e)}") from e
            if attempt == attempts:
                tries = f"{attempts} attempts" if attempts > 1 else "1 attempt"
                raise ShardkitError(f"{what}: {type(e).__name__}: {one_line(e)} (gave up after {tries})") from e
            time.sleep(random.uniform(0, min(cap_s, base_s * 2 ** (attempt - 1))))
    raise AssertionError("unreachable")


def attempts_for(url: str) -> int:
    """Our attempts at a request to `url`. gcsfs retries every failed request up to 6 times
    itself, with backoff (no option turns that off; a body cut short and a silent connection
    included): those are the retries on GCS, not multiplied by ours."""
    return 1 if url.split("://", 1)[0] in _GCS else RETRIES


def _naming(e: Exception, what: str) -> Exception:
    """`e`, or the same kind of error saying `what` failed when `e` does not say (a client's
    "Access Denied" or "The specified key does not exist" name no URL), on one line."""
    text = one_line(e)
    if isinstance(e, ShardkitError) or what in text or getattr(e, "filename", None):
        return e
    try:
        return type(e)(f"{what}: {text}")
    except TypeError:  # an error class with a constructor of its own
        return e


def read_bytes(url: str, storage_options: StorageOptions | None = None) -> bytes:
    if is_local(url):
        # os-level calls: about half the cost of open().read() for the many small files a pack reads
        fd = os.open(local_path(url), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            chunks = [os.read(fd, os.fstat(fd).st_size + 1)]  # normally the whole file
            while chunks[-1]:  # up to end of file, should it have grown or the read come up short
                chunks.append(os.read(fd, 1 << 20))
            return chunks[0] if len(chunks) == 2 else b"".join(chunks)
        finally:
            os.close(fd)
    fs, path = filesystem(url, storage_options)
    return retrying(display(url), lambda: fs.cat_file(path), attempts_for(url))


def read_range(url: str, start: int, stop: int, storage_options: StorageOptions | None = None) -> bytes:
    """Bytes [start, stop) of a file."""
    if is_local(url):
        with open(local_path(url), "rb") as f:
            data = os.pread(f.fileno(), stop - start, start)
    else:
        fs, path = filesystem(url, storage_options)
        data = retrying(display(url), lambda: fs.cat_file(path, start=start, end=stop), attempts_for(url))
    if len(data) != stop - start:
        raise CorruptShardError(f"{display(url)}: {len(data)} bytes at offset {start}, expected {stop - start}")
    return data


def open_read(url: str, storage_options: StorageOptions | None = None) -> BinaryIO:
    """A binary file for sequential reading."""
    if is_local(url):
        return open(local_path(url), "rb", buffering=1 << 20)
    fs, path = filesystem(url, storage_options)
    return fs.open(path, "rb", block_size=8 << 20)


def exists(url: str, storage_options: StorageOptions | None = None) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache(path)
    return fs.exists(path)


def size(url: str, storage_options: StorageOptions | None = None) -> int | None:
    """Size in bytes, or None if the object does not exist."""
    if is_local(url):
        try:
            return os.stat(local_path(url)).st_size
        except FileNotFoundError:
            return None
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache(path)  # other processes may have written it since
    try:
        return fs.size(path)
    except FileNotFoundError:
        return None


def listdir(url: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Base names directly under a directory or prefix; [] if it does not exist."""
    if is_local(url):
        try:
            return sorted(os.listdir(local_path(url)))
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache(path)
    try:
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def remove(url: str, storage_options: StorageOptions | None = None) -> None:
    if is_local(url):
        with contextlib.suppress(FileNotFoundError):
            os.remove(local_path(url))
        return
    fs, path = filesystem(url, storage_options)
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)


def makedirs(url: str, storage_options: StorageOptions | None = None) -> None:
    if is_local(url):
        os.makedirs(local_path(url), exist_ok=True)
    else:
        fs, path = filesystem(url, storage_options)
        fs.makedirs(path, exist_ok=True)


TMP_MARK = ".tmp-"
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"}


@contextlib.contextmanager
def atomic_writer(url: str, storage_options: StorageOptions | None = None) -> Iterator[BinaryIO]:
    """A file that appears under `url` only once it is complete.

    Locally: write `url.tmp-<random>` (with direct I/O where the file system allows it, see
    seqwrite.py), fsync, rename into place; on error the temporary file is removed. On
    object stores an upload becomes visible only when it completes, so the object is written
    in place and an error aborts the upload.
    """
    if is_local(url):
        path = local_path(url)
        tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        f = SequentialWriter(tmp)
        try:
            try:
                yield f  # type: ignore[misc]
                f.finish()
            finally:
                f.close()
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise
        return
    fs, path = filesystem(url, storage_options)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & _OBJECT_STORES:
        target = path  # an upload becomes visible only when complete
    else:
        target = f"{path}{TMP_MARK}{uuid.uuid4().hex[:12]}"  # e.g. HDFS: visible while written
    remote = fs.open(target, "wb")
    try:
        yield remote
    except BaseException:
        discard = getattr(remote, "discard", None)
        if discard is not None:
            discard()
        if target != path:
            with contextlib.suppress(OSError):
                fs.rm_file(target)
        raise
    remote.close()
    if target != path:
        if fs.exists(path):  # a rename onto an existing file fails on HDFS
            fs.rm_file(path)
        fs.mv(target, path)
        fs.invalidate_cache(path)
        if not fs.exists(path):  # WebHDFS reports a refused RENAME as `false`, not an error
            raise ShardkitError(f"{display(url)}: could not rename the finished upload into place")


def write_bytes_atomic(url: str, data: bytes, storage_options: StorageOptions | None = None) -> None:
    with atomic_writer(url, storage_options) as f:
        f.write(data)


def remove_dir(url: str, storage_options: StorageOptions | None = None) -> None:
    """Remove an empty directory (a no-op on object stores, which have none)."""
    if is_local(url):
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(local_path(url))


class RangeReader:
    """Byte ranges of a fixed list of shards, thread-safe.

    Local files are read with pread, straight into the caller's bytes (`read_at`), and
    `advise` starts the disk read-ahead of a range before it is needed. Remote shards take
    ranged GETs through fsspec, retried on transient errors, and go through the optional
    local cache.
    """

    def __init__(self, urls: list[str], storage_options: StorageOptions | None = None,
                 versions: list[str | None] | None = None, cache: RangeCache | None = None, verify: bool = False):
        self._urls = urls
        self._opts = storage_options
        self._versions = versions or [None] * len(urls)
        self._cache = cache
        self._verify = verify
        self._local = [is_local(u) for u in urls]
        self._handles: dict[int, Any] = {}  # shard -> fd, or (filesystem, path)
        self._instances: dict[tuple[Any, ...], Any] = {}
        self._bad: dict[int, CorruptShardError] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.fetched_bytes = 0  # downloaded from remote storage (cache hits excluded)

    def _handle(self, shard: int) -> Any:
        handle = self._handles.get(shard)
        if handle is not None:
            return handle
        with self._lock:  # one opener per shard; close() waits for it
            if self._closed:
                raise ShardkitError("read after the reader was closed")
            if shard in self._bad:
                raise self._bad[shard]
            handle = self._handles.get(shard)
            if handle is None:
                if self._local[shard]:
                    handle = os.open(local_path(self._urls[shard]), os.O_RDONLY)
                else:
                    handle = filesystem(self._urls[shard], self._reader_options(shard), self._instances)
                    if hasattr(handle[0], "retries"):  # s3fs: retry in one place (ours), not retries^2 times
                        handle[0].retries = 1
                if self._verify:
                    try:
                        self._check_sha256(shard, handle)
                    except ShardkitError as e:
                        self._bad[shard] = e  # hash (or fail to) once, not once per read in flight
                        if self._local[shard]:
                            os.close(handle)
                        raise
                self._handles[shard] = handle
        return handle

    def _check_sha256(self, shard: int, handle: Any) -> None:
        """Hash the whole shard once (the first time this reader touches it) against the index."""
        expected = self._versions[shard]
        if expected is None:
            return

        def digest() -> str:
            sha = hashlib.sha256()
            if self._local[shard]:
                pos = 0
                while chunk := os.pread(handle, 8 << 20, pos):
                    sha.update(chunk)
                    pos += len(chunk)
            else:
                fs, path = handle
                with fs.open(path, "rb", block_size=8 << 20) as f:
                    while chunk := f.read(8 << 20):
                        sha.update(chunk)
            return sha.hexdigest()

        url = self._urls[shard]
        if retrying(f"{display(url)} (sha256 check)", digest, attempts_for(url)) != expected:
            raise CorruptShardError(f"{display(url)}: sha256 mismatch with the index (shard changed or corrupt)")

    def _reader_options(self, shard: int) -> StorageOptions | None:
        """The user's options; for S3, unless the user configured the client, its own
        retries are turned off too, so a failing read takes `RETRIES` attempts, not
        RETRIES x s3fs x botocore attempts."""
        opts = self._opts or {}
        if self._urls[shard].split("://", 1)[0] in ("s3", "s3a") and "config_kwargs" not in opts:
            return {**opts, "config_kwargs": {"retries": {"total_max_attempts": 1}}}
        return self._opts

    def is_local(self, shard: int) -> bool:
        return self._local[shard]

    def read_at(self, shard: int) -> ReadAt:
        """`read_at(size, offset)` on a local shard, valid until close(): fewer bytes only
        where the file ends (a short read mid-file, as FUSE and NFS mounts may give, is
        continued). An I/O error is a ShardkitError naming the shard: not bad data."""
        if not self._local[shard]:
            raise ValueError(f"{display(self._urls[shard])}: a remote shard is read by range, not read_at")
        fd, url = self._handle(shard), self._urls[shard]

        def read_at(size: int, offset: int) -> bytes:
            if self._closed:
                raise ShardkitError("read after the reader was closed")
            try:
                data = os.pread(fd, size, offset)
                while 0 < len(data) < size and (more := os.pread(fd, size - len(data), offset + len(data))):
                    data += more
            except OSError as e:
                raise ShardkitError(f"{display(url)}: reading bytes {offset}-{offset + size}: "
                                    f"{type(e).__name__}: {one_line(e)}") from e
            return data

        return read_at

    def advise(self, shard: int, start: int, stop: int) -> None:
        """Ask the kernel to start reading bytes [start, stop) of a local shard into the page
        cache, and return. A hint: where it cannot be given (macOS), nothing."""
        if self._local[shard] and stop > start and _WILLNEED is not None:
            with contextlib.suppress(OSError):
                os.posix_fadvise(self._handle(shard), start, stop - start, _WILLNEED)

    def read(self, shard: int, start: int, stop: int, partial: bool = False) -> bytes:
        """Bytes [start, stop) of a shard. A shard that ends before `stop` (truncated or
        replaced) raises CorruptShardError, or with `partial` gives the bytes up to its end,
        for the caller to tell which samples are whole."""
        if self._local[shard]:
            data = self.read_at(shard)(stop - start, start)
            if len(data) < stop - start and not partial:
                raise self._short(shard, start, stop, len(data))
            return data
        handle = self._handle(shard)
        url, version = self._urls[shard], self._versions[shard]
        if self._cache is not None:
            cached = self._cache.get(url, version, start, stop)
            if cached is not None:
                return cached
        fs, path = handle

        def get() -> bytes:
            data = fs.cat_file(path, start=start, end=stop)
            if len(data) > stop - start:
                raise self._short(shard, start, stop, len(data))
            if len(data) < stop - start:
                fs.invalidate_cache(path)
                if fs.size(path) < stop:  # the object does end there
                    if partial:
                        return data
                    raise self._short(shard, start, stop, len(data))
                raise OSError(f"short read: {len(data)} of {stop - start} bytes")  # a cut-short body: retried
            return data

        data = retrying(f"{display(url)} (bytes {start}-{stop})", get, attempts_for(url))
        with self._lock:
            self.fetched_bytes += len(data)
        if self._cache is not None and len(data) == stop - start:
            self._cache.put(url, version, start, stop, data)
        return data

    def _short(self, shard: int, start: int, stop: int, got: int) -> CorruptShardError:
        return CorruptShardError(
            f"{display(self._urls[shard])}: {got} bytes at offset {start}, the index expects {stop - start} "
            "(shard truncated or replaced)"
        )

    def close(self) -> None:
        """Close the files. Reads still running on read-ahead threads fail cleanly after this."""
        with self._lock:
            self._closed = True
            for shard, handle in self._handles.items():
                if self._local[shard]:
                    os.close(handle)
            self._handles.clear()
