"""The only module that talks to storage. Local paths take a direct os path (fast, no
fsspec overhead); everything else goes through fsspec with the caller's storage options
passed through unchanged."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast


from . import executors
from .errors import (AccessDeniedError, BadRequestError, CorruptShardError, NotFoundError, ShardkitError, one_line,
                     name_file, redact)
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
_WEBHDFS = ("webhdfs",)
_HTTP = ("http", "https")
_S3 = ("s3", "s3a")
_ONE_ATTEMPT = {"retries": {"total_max_attempts": 1}}  # botocore's config: no retries of its own
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


def _protocol(url: str) -> str:
    return url.split("://", 1)[0]


def _socket_timeout() -> Any:
    """An aiohttp deadline per socket operation, as requests has: a connection silent for
    REQUEST_TIMEOUT_S fails (and is retried); a slow download that keeps moving is not cut off."""
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=REQUEST_TIMEOUT_S)


@functools.cache
def _quiet_gcsfs() -> None:
    """gcsfs logs a request it gave up on with its traceback: a handler of its own keeps
    Python's last-resort one from printing it on stderr, over shardkit's one-line error
    (an application that set logging up still gets the records)."""
    logging.getLogger("gcsfs").addHandler(logging.NullHandler())


def _harden(fs: Any, protocol: str) -> None:
    """Give a requests-based filesystem (WebHDFS) a deadline per request, and have a
    datanode's error raise: fsspec checks the namenode's answers, but takes a datanode's
    error page for the file's bytes (an index that reads as JSON garbage, a shard whose
    sha256 "changed")."""
    try:
        import requests
    except ImportError:  # then no filesystem in use is built on it
        return
    session = getattr(fs, "session", None)
    if not isinstance(session, requests.Session) or getattr(session, "_shardkit", False):
        return  # fsspec hands out one instance for the same options: harden it once
    session._shardkit = True
    for prefix in ("http://", "https://"):
        session.mount(prefix, _timeout_adapter()())
    if protocol in _WEBHDFS:
        session.hooks["response"].append(functools.partial(_datanode_errors, _netloc(fs._apply_proxy(fs.url))))


def _netloc(url: str) -> tuple[str | None, int | None]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname, parts.port


def _datanode_errors(namenode: tuple[str | None, int | None], response: Any, *args: Any, **kwargs: Any) -> None:
    """A datanode's error answer raises (fsspec reads its body as the file's bytes). 404 is a
    missing file; anything else is tried again: HDFS's datanodes answer every IOException
    with 403 (a bad replica, an expired block token), and a new OPEN may get another one."""
    if response.status_code < 400 or _netloc(response.url) == namenode:
        return
    if response.status_code == 404:
        response.raise_for_status()
    raise ConnectionError(f"the datanode answered {response.status_code} {response.reason}: "
                          f"{one_line(response.text[:300])}")


def filesystem(url: str, storage_options: StorageOptions | None = None,
               instances: dict[tuple[Any, ...], Any] | None = None, client_retries: bool = True) -> tuple[Any, str]:
    """(fsspec filesystem, path within it), one instance per process, protocol, host and
    options, kept in `instances` (this module's by default). Missing backends get an
    install hint. Without `client_retries` the caller retries (`retrying`) and S3's own
    retries are off (botocore's unless the options configure them, and s3fs's), so a
    failing request takes `RETRIES` attempts, not RETRIES x s3fs x botocore."""
    import fsspec
    import fsspec.core

    protocol = _protocol(url)
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
    if protocol in _GCS:
        _quiet_gcsfs()
        if "requests_timeout" not in kwargs:  # gcsfs waits forever on a stalled connection
            kwargs["requests_timeout"] = _socket_timeout()
    client = kwargs.get("client_kwargs") or {}  # None: fsspec's default
    if protocol in _HTTP and "timeout" not in client:
        # aiohttp's default: 300 s a request, so a black hole takes 5 x 300 s to fail, and a
        # slow download is cut off at 300 s
        kwargs["client_kwargs"] = {**client, "timeout": _socket_timeout()}
    ours = protocol in _S3 and not client_retries
    if ours:  # an instance of its own (fs.retries is set below), never fsspec's shared one, made once a process
        kwargs["config_kwargs"] = {**_ONE_ATTEMPT, **(kwargs.get("config_kwargs") or {})}
        kwargs["skip_instance_cache"] = True
    key = (os.getpid(), protocol, ours, json.dumps(kwargs, sort_keys=True, default=repr))
    cache = _FILESYSTEMS if instances is None or ours else instances
    fs = cache.get(key)
    if fs is None:
        try:
            fs = cls(**kwargs)
        except ImportError as e:  # hdfs://: pyarrow is imported when the client is made
            hint = "; it needs `pip install pyarrow` and Hadoop's libhdfs" if protocol == "hdfs" else ""
            raise ShardkitError(f"{display(url)}: {protocol}:// support is not installed ({one_line(e)}{hint})") from e
        except (TypeError, ValueError) as e:
            raise BadRequestError(f"{display(url)}: storage options refused by {protocol}://: {redact(one_line(e))}") from e
        except Exception as e:  # noqa: BLE001 - a client that checks its credentials as it is made (gcsfs)
            raise ShardkitError(f"{display(url)}: cannot set up {protocol}://: {type(e).__name__}: "
                                f"{redact(one_line(e))}") from e
        _harden(fs, protocol)
        if ours:
            fs.retries = 1  # a class attribute of s3fs, not an option
        fs = cache.setdefault(key, fs)
    return fs, cls._strip_protocol(url)


_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)  # posix_fadvise: Linux and BSDs, not macOS

RETRIES = 5  # attempts at a request: a wrong endpoint or dead store fails in seconds
OUTAGE_RETRIES = 10  # a dataset's reads, once it has read its index: waits of up to ~43 s (~21 s on average),
# so a blip or a restart of the store does not end a training run
_TRANSIENT_4XX = {408, 409, 425, 429}  # timeout, conflict, too early, throttled: worth another attempt
_THROTTLED = {429, 503}  # the store asks for fewer requests (S3's SlowDown is a 503)
THROTTLED_BASE_S = 1.0  # ...so the backoff starts at a second: 5 attempts span up to ~15 s, not ~3 s (10: ~65 s)
_SAY = {NotFoundError: "not found (no such object, or no such bucket)", AccessDeniedError: "access denied"}
_BY_STATUS = {401: AccessDeniedError, 403: AccessDeniedError, 404: NotFoundError, 410: NotFoundError}


def retrying(what: str, fn: Callable[[], T], attempts: int = RETRIES, base_s: float = 0.2, cap_s: float = 10.0) -> T:
    """Call `fn`, retrying transient failures (resets, timeouts, 5xx, throttling) with
    exponential backoff and full jitter. Fail with one line naming `what` (a URL: never the
    storage options): at once for an error no retry can fix (see `_permanent`), else after
    `attempts`. A ShardkitError from `fn` passes unchanged."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except ShardkitError:
            raise
        except Exception as e:  # noqa: BLE001 - the remote client's errors have no common base
            kind = _permanent(e)
            if kind is not None:
                reason = redact(one_line(e)).removeprefix(what).lstrip(": ")  # some name the URL, some only it
                if re.fullmatch(r"\S+://\S*", reason) or (reason and " " not in reason and reason in what):
                    reason = _SAY.get(kind, "")  # gcsfs's 404 says nothing but the request's URL, s3fs's the path
                raise kind(f"{what}: {reason or type(e).__name__}") from e
            if attempt == attempts:
                tries = f"{attempts} attempts" if attempts > 1 else "1 attempt"
                if what.startswith(tuple(f"{p}://" for p in _GCS)):
                    tries = "gcsfs's own retries"  # ours is 1 attempt: see attempts_for
                said = redact(one_line(e)) or ("no answer within the timeout" if "Timeout" in type(e).__name__ else "")
                raise ShardkitError(f"{what}: {type(e).__name__}{': ' * bool(said)}{said} (gave up after {tries})") from e
            executors.stop_point()  # a pack given up (Ctrl-C) tries no more: an attempt can take a minute
            base = max(base_s, THROTTLED_BASE_S) if _status(_root_cause(e)) in _THROTTLED else base_s
            time.sleep(random.uniform(0, min(cap_s, base * 2 ** (attempt - 1))))
    raise AssertionError("unreachable")


def attempts_for(url: str, patient: bool = False) -> int:
    """Our attempts at a request to `url`; `patient` ones ride out an outage (see
    OUTAGE_RETRIES). gcsfs retries every failed request up to 6 times itself, with backoff
    (no option turns that off; a body cut short and a silent connection included): those
    are the retries on GCS, not multiplied by ours."""
    if _protocol(url) in _GCS:
        return 1
    return OUTAGE_RETRIES if patient else RETRIES


def _causes(e: BaseException) -> Iterator[BaseException]:
    """`e`, the error it was raised from, and so on down (8 causes at most)."""
    for _ in range(9):
        yield e
        if e.__cause__ is None:
            return
        e = e.__cause__


def _root_cause(e: BaseException) -> BaseException:
    """The last of `_causes`: fsspec's HTTP client raises FileNotFoundError from a 403 or a
    refused connection alike, so the cause is what tells."""
    *_, root = _causes(e)
    return root


# A connection dropped, or a body cut short: worth another attempt, wherever in the chain of
# causes (aiohttp's parse errors carry a `code` of 400 that is no HTTP status).
_CUT_SHORT = {"ClientPayloadError", "ServerDisconnectedError", "ClientConnectionError", "HttpProcessingError",
              "IncompleteRead", "ChunkedEncodingError", "ResponseStreamingError", "IncompleteReadError"}


def _cut_short(e: BaseException) -> bool:
    return any(c.__name__ in _CUT_SHORT for cause in _causes(e) for c in type(cause).__mro__)


def _status(e: BaseException) -> int | None:
    """The HTTP status a client's error carries: aiohttp's `status`, gcsfs's `code`,
    requests' `response.status_code`, botocore's response metadata."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        found = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    elif response is not None:
        found = getattr(response, "status_code", None)
    else:
        found = getattr(e, "status", None) or getattr(e, "code", None)
    return found if isinstance(found, int) and 100 <= found < 600 else None


def _from_botocore(e: BaseException, *names: str) -> bool:
    return any(c.__name__ in names and c.__module__.startswith("botocore") for c in type(e).__mro__)


def _permanent(e: BaseException) -> type[ShardkitError] | None:
    """The kind of error to raise for a failure no retry can fix, judged by its root cause;
    None for one worth retrying."""
    if _cut_short(e):
        return None
    e = _root_cause(e)
    status = _status(e)
    if status is not None:
        return _BY_STATUS.get(status, BadRequestError) if 400 <= status < 500 and status not in _TRANSIENT_4XX else None
    if isinstance(e, FileNotFoundError):
        return NotFoundError
    if (isinstance(e, PermissionError) or _from_botocore(e, "NoCredentialsError", "PartialCredentialsError")
            or (type(e) is OSError and str(e).startswith("Forbidden"))):  # gcsfs's HTTP 403
        return AccessDeniedError
    if isinstance(e, (ValueError, TypeError, IsADirectoryError, NotADirectoryError, FileExistsError)) or \
            _from_botocore(e, "ParamValidationError"):  # an invalid bucket name, request or option (a typo)
        return BadRequestError
    return None


def _ask(url: str, storage_options: StorageOptions | None, op: Callable[[Any, str], T]) -> T:
    """`op(filesystem, path)` for a remote URL, retried (see `retrying`). Listings are looked
    up afresh: other processes may have written since."""
    fs, path = filesystem(url, storage_options, client_retries=False)

    def call() -> T:
        fs.invalidate_cache(path)
        return op(fs, path)

    return retrying(display(url), call, attempts_for(url))


def _cat_range(fs: Any, path: str, start: int, stop: int, url: str) -> bytes:
    """Bytes [start, stop) of the remote file `url`: fewer where it ends before `stop`, none
    where it ends before `start` (GCS and WebHDFS answer that with no bytes, S3 and HTTP with
    416). More is a server that ignores ranges: BadRequestError (no retry helps)."""
    try:
        data: bytes = (_webhdfs_range(fs, path, start, stop) if _protocol(url) in _WEBHDFS
                       else fs.cat_file(path, start=start, end=stop))
    except Exception as e:
        if _status(_root_cause(e)) == 416:
            return b""
        raise
    if len(data) > stop - start:  # the whole file, as `python -m http.server` sends: the shard is fine
        raise BadRequestError(f"{display(url)}: the server sent {len(data)} bytes for a range of {stop - start}: it "
                              "ignores range requests, which streaming needs; serve the shards from one that supports "
                              "them (nginx, S3, GCS) or copy them to local disk")
    return data


def _webhdfs_range(fs: Any, path: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) in one OPEN. fsspec's WebHDFS reads a range through a buffered
    file: a size lookup first, then up to 4 MiB past the range (8x the bytes of a small
    block)."""
    try:
        out = fs._call("OPEN", path=path, offset=start, length=stop - start, redirect=False)
        if "Location" in out.headers:  # the namenode sends the client on to a datanode
            out = fs.session.get(fs._apply_proxy(out.headers["Location"]))
    except (RuntimeError, ConnectionError):  # an IOException: HDFS refuses an offset at or past the end (403),
        if start >= fs.info(path)["size"]:  # where other stores answer no bytes
            return b""
        raise
    return out.content  # type: ignore[no-any-return]


def read_bytes(url: str, storage_options: StorageOptions | None = None) -> bytes:
    if is_local(url):
        # os-level calls: about half the cost of open().read() for the many small files a pack reads
        fd = os.open(local_path(url), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            chunks = [os.read(fd, os.fstat(fd).st_size + 1)]  # normally the whole file
            while chunks[-1]:  # up to end of file, should it have grown or the read come up short
                chunks.append(os.read(fd, 1 << 20))
            return chunks[0] if len(chunks) == 2 else b"".join(chunks)
        except OSError as e:  # os.read names no file: a folder (EISDIR), an I/O error
            name_file(e, local_path(url))
            raise
        finally:
            os.close(fd)
    return _ask(url, storage_options, lambda fs, path: fs.cat_file(path))  # type: ignore[no-any-return]


def read_range(url: str, start: int, stop: int, storage_options: StorageOptions | None = None) -> bytes:
    """Bytes [start, stop) of a file."""
    if is_local(url):
        with open(local_path(url), "rb") as f:
            data = os.pread(f.fileno(), stop - start, start)
    else:
        data = _ask(url, storage_options, lambda fs, path: _cat_range(fs, path, start, stop, url))
    if len(data) != stop - start:
        raise CorruptShardError(f"{display(url)}: {len(data)} bytes at offset {start}, expected {stop - start}")
    return data


def open_read(url: str, storage_options: StorageOptions | None = None) -> BinaryIO:
    """A binary file for sequential reading."""
    if is_local(url):
        return open(local_path(url), "rb", buffering=1 << 20)
    remote = _ask(url, storage_options, lambda fs, path: fs.open(path, "rb", block_size=8 << 20))
    return cast(BinaryIO, _RemoteFile(remote, url))


class _RemoteFile:
    """A remote file open for reading (`read` only), its reads retried like every request."""

    def __init__(self, f: Any, url: str):
        self._f, self._url = f, url

    def read(self, n: int = -1) -> bytes:
        # a failed read leaves fsspec's file where it was: the retry asks for the same bytes
        what, attempts = display(self._url), attempts_for(self._url)
        return retrying(what, lambda: self._f.read(n), attempts)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> _RemoteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exists(url: str, storage_options: StorageOptions | None = None) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    try:  # fsspec's exists() answers False to any error: a refused or failed request included
        _ask(url, storage_options, lambda fs, path: fs.info(path))
    except FileNotFoundError:
        return False
    return True


def size(url: str, storage_options: StorageOptions | None = None) -> int | None:
    """Size in bytes, or None if the object does not exist."""
    if is_local(url):
        try:
            return os.stat(local_path(url)).st_size
        except FileNotFoundError:
            return None
    try:
        return _ask(url, storage_options, lambda fs, path: fs.size(path))  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


_VERSION_MARKS = ("ETag", "etag", "generation", "VersionId", "md5Hash", "LastModified", "Last-Modified",
                  "modificationTime", "mtime", "updated")  # S3, GCS, HTTP, WebHDFS


def version(url: str, storage_options: StorageOptions | None = None) -> tuple[int, str]:
    """(size, mark) of a remote object, the mark being what its store changes when it is
    replaced: its ETag, generation or modification time."""
    info = _ask(url, storage_options, lambda fs, path: fs.info(path))
    return int(info["size"]), next((str(info[k]) for k in _VERSION_MARKS if info.get(k)), "")


def endpoint(storage_options: StorageOptions | None) -> str:
    """Where the options point S3 or GCS ('' for the default): one URL on two endpoints
    names two objects."""
    opts = storage_options or {}
    return str(opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url") or "")


def find(url: str, storage_options: StorageOptions | None = None) -> dict[str, dict[str, Any]]:
    """Every object under a remote prefix, recursively, with its details: {path: info};
    empty where there is none."""
    try:
        return _ask(url, storage_options, lambda fs, path: fs.find(path.rstrip("/"), detail=True))  # type: ignore[no-any-return]
    except FileNotFoundError:
        return {}


def listdir(url: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Base names directly under a directory or prefix; [] if it does not exist."""
    if is_local(url):
        try:
            return sorted(os.listdir(local_path(url)))
        except (FileNotFoundError, NotADirectoryError):
            return []
    try:
        paths = _ask(url, storage_options, lambda fs, path: fs.ls(path, detail=False))
    except FileNotFoundError:
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in paths)


def remove(url: str, storage_options: StorageOptions | None = None) -> None:
    if is_local(url):
        with contextlib.suppress(FileNotFoundError):
            os.remove(local_path(url))
        return
    with contextlib.suppress(FileNotFoundError):
        _ask(url, storage_options, lambda fs, path: fs.rm_file(path))


def makedirs(url: str, storage_options: StorageOptions | None = None) -> None:
    """Make the folder `url`. Object stores have none to make, and fsspec's makedirs would
    create the bucket: a typo in its name would make a new one, so it is left alone (a write
    into a bucket that is not there fails, naming it)."""
    if is_local(url):
        os.makedirs(local_path(url), exist_ok=True)
    elif _protocol(url) not in _OBJECT_STORES:
        _ask(url, storage_options, lambda fs, path: fs.makedirs(path, exist_ok=True))


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
            _sync_folder(os.path.dirname(path) or ".")
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            if isinstance(e, OSError):  # a full disk, an I/O error: say where
                name_file(e, path)
            raise
        return
    fs, path = filesystem(url, storage_options)  # the client's own retries on: only it can retry an upload
    what = display(url)
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & _OBJECT_STORES:
        target = path  # an upload becomes visible only when complete
    else:
        target = f"{path}{TMP_MARK}{uuid.uuid4().hex[:12]}"  # e.g. HDFS: visible while written
    remote = retrying(what, lambda: fs.open(target, "wb"), 1)
    try:
        yield cast(BinaryIO, _Upload(remote, what))
        retrying(what, remote.close, 1)
        if target != path:
            retrying(what, lambda: _rename_into_place(fs, target, path, what), 1)
    except BaseException:
        _abandon(remote)
        if target != path:
            with contextlib.suppress(Exception):
                fs.rm_file(target)
        raise


class _Upload:
    """The file an upload is written through (`write` only): a client's failure becomes one
    line naming the URL."""

    def __init__(self, f: Any, what: str):
        self._f, self._what = f, what

    def write(self, data: bytes) -> int:
        return retrying(self._what, lambda: self._f.write(data), 1)  # type: ignore[no-any-return]


def _abandon(f: Any) -> None:
    """Throw an unfinished upload away: nothing may appear under its name, now or later (a
    discarded fsspec file still open would upload what it holds when garbage-collected)."""
    with contextlib.suppress(Exception):  # the error that stopped the upload is the one to report
        f.discard()
    with contextlib.suppress(AttributeError):  # files other than fsspec's buffered ones hold nothing back
        f.closed = True


def _rename_into_place(fs: Any, target: str, path: str, what: str) -> None:
    if fs.exists(path):  # a rename onto an existing file fails on HDFS
        fs.rm_file(path)
    fs.mv(target, path)
    fs.invalidate_cache(path)
    if not fs.exists(path):  # WebHDFS reports a refused RENAME as `false`, not an error
        raise ShardkitError(f"{what}: could not rename the finished upload into place")


def _sync_folder(path: str) -> None:
    """Make a rename in `path` durable: after a power loss the new name is there, or the old."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform without directory handles (Windows)
        return
    try:
        with contextlib.suppress(OSError):  # some file systems refuse fsync on a folder: nothing more to do there
            os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(url: str, data: bytes, storage_options: StorageOptions | None = None) -> None:
    with atomic_writer(url, storage_options) as f:
        f.write(data)


def remove_dir(url: str, storage_options: StorageOptions | None = None) -> None:
    """Remove an empty directory (a no-op on object stores, which have none); best effort."""
    if is_local(url):
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(local_path(url))
        return
    if _protocol(url) not in _OBJECT_STORES:  # WebHDFS, HDFS: real folders (fsspec's rmdir is a no-op there)
        with contextlib.suppress(OSError, ShardkitError):
            _ask(url, storage_options, lambda fs, path: fs.rm(path, recursive=True) if not fs.ls(path) else None)


class RangeReader:
    """Byte ranges of a fixed list of shards, thread-safe.

    Local files are read with pread, straight into the caller's bytes (`read_at`), and
    `advise` starts the disk read-ahead of a range before it is needed. Remote shards take
    ranged GETs through fsspec, retried on transient errors (`patient`: for as long as an
    outage of the store may last, see OUTAGE_RETRIES), and go through the optional local
    cache.
    """

    def __init__(self, urls: list[str], storage_options: StorageOptions | None = None,
                 versions: list[str | None] | None = None, cache: RangeCache | None = None, verify: bool = False,
                 patient: bool = False):
        self._urls = urls
        self._patient = patient  # the caller has reached the store: reads ride out an outage
        self._opts = storage_options
        self._versions = versions or [None] * len(urls)
        self._cache = cache
        self._verify = verify
        self._local = [is_local(u) for u in urls]
        self._handles: dict[int, Any] = {}  # shard -> fd, or (filesystem, path)
        self._instances: dict[tuple[Any, ...], Any] = {}
        self._bad: dict[int, ShardkitError] = {}
        self._opening: dict[int, threading.Lock] = {}
        self._lock = threading.Lock()  # held for moments only: never across a read or a hash
        self._closed = False
        self.fetched_bytes = 0  # downloaded from remote storage, sha256 checks included (cache hits excluded)

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
                self._handles[shard] = handle
        return handle

    def _open(self, shard: int) -> Any:
        if self._local[shard]:
            try:
                handle = os.open(local_path(self._urls[shard]), os.O_RDONLY)
            except OSError as e:
                kind = {FileNotFoundError: NotFoundError, PermissionError: AccessDeniedError}.get(type(e), ShardkitError)
                raise kind(f"{display(self._urls[shard])}: {type(e).__name__}: {one_line(e)}") from e
        else:
            handle = filesystem(self._urls[shard], self._opts, self._instances, client_retries=False)
        if self._verify:
            try:
                self._check_sha256(shard, handle)
            except ShardkitError:
                if self._local[shard]:
                    os.close(handle)
                raise
        return handle

    def _check_sha256(self, shard: int, handle: Any) -> None:
        """Hash the whole shard once (the first time this reader touches it) against the
        index; a close() stops it at its next chunk."""
        expected = self._versions[shard]
        if expected is None:
            return

        def digest() -> str:
            sha, done = hashlib.sha256(), 0
            f = None if self._local[shard] else handle[0].open(handle[1], "rb", block_size=8 << 20)
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

        url = self._urls[shard]
        if retrying(f"{display(url)} (sha256 check)", digest, attempts_for(url, self._patient)) != expected:
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
        fd, url = self._handle(shard), self._urls[shard]

        def read_at(size: int, offset: int) -> bytes:
            if self._closed:  # _check_open, inlined: this runs for every member of every sample
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
        cache = self._cache if version is not None else None  # without a sha256, a replaced shard looks the same
        if cache is not None:
            cached = cache.get(url, version, start, stop)
            if cached is not None:
                return cached
        fs, path = handle

        def get() -> bytes:
            self._check_open()
            data = _cat_range(fs, path, start, stop, url)
            if len(data) < stop - start:
                fs.invalidate_cache(path)
                if fs.size(path) < stop:  # the object does end there
                    if partial:
                        return data
                    raise self._short(shard, start, stop, len(data))
                raise OSError(f"short read: {len(data)} of {stop - start} bytes")  # a cut-short body: retried
            return data

        data = retrying(f"{display(url)} (bytes {start}-{stop})", get, attempts_for(url, self._patient))
        with self._lock:
            self.fetched_bytes += len(data)
        if cache is not None and len(data) == stop - start:
            cache.put(url, version, start, stop, data)
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
