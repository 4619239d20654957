"""One-shot file operations (read, list, remove, ...): local paths through os, the rest
through fsspec, retried."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar, cast

from ..errors import BadRequestError, CorruptShardError, ShardkitError, name_file
from . import s3_http
from .clients import filesystem
from .retry import attempts_for, retrying, root_cause, status_of
from .urls import GCS, OBJECT_STORES, S3, WEBHDFS, StorageOptions, display, is_local, local_path, scheme


T = TypeVar("T")


def _ask(url: str, storage_options: StorageOptions | None, op: Callable[[Any, str], T]) -> T:
    """`op(filesystem, path)` for a remote URL, retried (see `retrying`). Listings are looked
    up afresh: other processes may have written since."""
    fs, path = filesystem(url, storage_options, client_retries=False)

    def call() -> T:
        fs.invalidate_cache(path)
        return op(fs, path)

    return retrying(display(url), call, attempts_for(url))


def cat_range(fs: Any, path: str, start: int, stop: int, url: str) -> bytes:
    """Bytes [start, stop) of the remote file `url`: fewer where it ends before `stop`, none
    where it ends before `start` (GCS and WebHDFS answer that with no bytes, S3 and HTTP with
    416). More is a server that ignores ranges: BadRequestError (no retry helps)."""
    try:
        data: bytes = (_webhdfs_range(fs, path, start, stop) if scheme(url) in WEBHDFS
                       else fs.cat_file(path, start=start, end=stop))
    except Exception as e:
        if status_of(root_cause(e)) == 416:
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
    return cast(bytes, out.content)


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
    direct = s3_http.direct_for(url, storage_options)
    if direct is not None:
        return retrying(display(url), lambda: direct.cat(s3_http.path_of(url)), attempts_for(url))
    return _ask(url, storage_options, _cat_whole)


def _cat_whole(fs: Any, path: str) -> bytes:
    """A remote file's bytes in one request: s3fs asks an object's size first (a HEAD, one
    round trip more for every index.json read) unless told to read it in one piece."""
    if "max_concurrency" in inspect.signature(fs.cat_file).parameters:
        return cast(bytes, fs.cat_file(path, max_concurrency=1))
    return cast(bytes, fs.cat_file(path))


def read_range(url: str, start: int, stop: int, storage_options: StorageOptions | None = None) -> bytes:
    """Bytes [start, stop) of a file."""
    if is_local(url):
        with open(local_path(url), "rb") as f:
            data = os.pread(f.fileno(), stop - start, start)
    else:
        data = _ask(url, storage_options, lambda fs, path: cat_range(fs, path, start, stop, url))
    if len(data) != stop - start:
        raise CorruptShardError(f"{display(url)}: {len(data)} bytes at offset {start}, expected {stop - start}")
    return data


def open_read(url: str, storage_options: StorageOptions | None = None) -> BinaryIO:
    """A binary file for sequential reading."""
    if is_local(url):
        return open(local_path(url), "rb", buffering=1 << 20)
    direct = s3_http.direct_for(url, storage_options)
    if direct is not None:
        body = retrying(display(url), lambda: direct.open(s3_http.path_of(url)), attempts_for(url))
        return cast(BinaryIO, _RemoteFile(body, url))
    remote = _ask(url, storage_options, lambda fs, path: fs.open(path, "rb", block_size=8 << 20))
    return cast(BinaryIO, _RemoteFile(remote, url))


class _RemoteFile:
    """A remote file open for reading (`read` only), its reads retried like every request."""

    def __init__(self, f: Any, url: str):
        self._f, self._url = f, url

    def read(self, n: int = -1) -> bytes:
        # a failed read leaves fsspec's file (or s3_http's Body) where it was: the retry asks for the same bytes
        what, attempts = display(self._url), attempts_for(self._url)
        return cast(bytes, retrying(what, lambda: self._f.read(n), attempts))

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
        return cast(int, _ask(url, storage_options, lambda fs, path: fs.size(path)))
    except FileNotFoundError:
        return None


_VERSION_MARKS = ("ETag", "etag", "generation", "VersionId", "md5Hash", "LastModified", "Last-Modified",
                  "modificationTime", "mtime", "updated")  # S3, GCS, HTTP, WebHDFS


def version(url: str, storage_options: StorageOptions | None = None) -> tuple[int, str]:
    """(size, mark) of a remote object, the mark being what its store changes when it is
    replaced: its ETag, generation or modification time."""
    info = _ask(url, storage_options, lambda fs, path: fs.info(path))
    return int(info["size"]), next((str(info[k]) for k in _VERSION_MARKS if info.get(k)), "")


def pin_of(url: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """What the store changes when the object `url` is replaced, from its details (fsspec's
    info or listing): S3's ETag, GCS's generation, WebHDFS's modification time; None where
    the store gives none of them (HTTP)."""
    if scheme(url) in S3 and info.get("ETag"):
        return {"etag": str(info["ETag"])}
    if scheme(url) in GCS and info.get("generation"):
        return {"generation": str(info["generation"])}
    if scheme(url) in WEBHDFS and info.get("modificationTime"):
        return {"mtime_ns": int(info["modificationTime"]) * 1_000_000}
    return None


def pins(url: str, names: list[str], storage_options: StorageOptions | None = None) -> list[dict[str, Any] | None]:
    """The version (`pin_of`) of each file `names` directly under the folder `url`, from one
    listing; None for one not found, and for local files: their modification time changes
    with every plain copy (a copied dataset would fail every read) and would make index.json
    differ between two packs of the same input."""
    if is_local(url):
        return [None] * len(names)
    try:
        found = _ask(url, storage_options, lambda fs, path: fs.ls(path.rstrip("/"), detail=True))
    except FileNotFoundError:
        found = []
    listing = {info["name"].rstrip("/").rsplit("/", 1)[-1]: info for info in found}
    return [pin_of(url, listing[n]) if n in listing else None for n in names]


def find(url: str, storage_options: StorageOptions | None = None) -> dict[str, dict[str, Any]]:
    """Every object under a remote prefix, recursively, with its details: {path: info};
    empty where there is none."""
    try:
        return _ask(url, storage_options, lambda fs, path: fs.find(path.rstrip("/"), detail=True))
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
    elif scheme(url) not in OBJECT_STORES:
        _ask(url, storage_options, lambda fs, path: fs.makedirs(path, exist_ok=True))


def remove_dir(url: str, storage_options: StorageOptions | None = None) -> None:
    """Remove an empty directory (a no-op on object stores, which have none); best effort."""
    if is_local(url):
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(local_path(url))
        return
    if scheme(url) not in OBJECT_STORES:  # WebHDFS, HDFS: real folders (fsspec's rmdir is a no-op there)
        with contextlib.suppress(OSError, ShardkitError):
            _ask(url, storage_options, lambda fs, path: fs.rm(path, recursive=True) if not fs.ls(path) else None)
