"""Every other store, through its fsspec backend (gcsfs, HTTP, WebHDFS, HDFS, chained URLs,
anything registered): the client from clients.py, made once a process and options, with
shardkit's retries in place of its own.

Private API used here, written against fsspec 2026.9 and gcsfs 2026.10: in `WebHdfsStore`,
`fs._call`, `fs.session` and `fs._apply_proxy` of WebHDFS, for a ranged read in one OPEN;
in `GcsStore`, gcsfs's `fs.call` (its request, with gcsfs's retries and errors),
`fs.split_path` and `fs._location`, for uploads and deletes with `ifGenerationMatch`,
which gcsfs offers only as "create" (`mode="create"`, no replace or delete at a generation).
"""

from __future__ import annotations

import contextlib
import inspect
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO, cast
from urllib.parse import quote

from ...errors import BadRequestError, ShardkitError
from ..clients import filesystem
from ..retry import retrying, root_cause, status_of
from ..urls import OBJECT_STORES, StorageOptions, display, scheme
from .base import TMP_MARK, Sink, Store


class FsspecStore(Store):
    name = "fsspec"

    def __init__(
        self,
        storage_options: StorageOptions | None = None,
        patient: bool = False,
        instances: dict[tuple[Any, ...], Any] | None = None,
    ):
        super().__init__(storage_options, patient)
        self._instances = instances  # a reader's own clients (None: this process's)

    def client(self, url: str) -> tuple[Any, str]:
        """(fsspec filesystem, path within it) for `url`."""
        return filesystem(url, self.options, self._instances, client_retries=False)

    def ask(self, url: str, op: Any, what: str = "") -> Any:
        """`op(filesystem, path)`, retried; listings looked up afresh (other processes may
        have written since)."""
        fs, path = self.client(url)

        def call() -> Any:
            fs.invalidate_cache(path)
            return op(fs, path)

        return self.retried(url, what, call)

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        fs, path = self.client(url)
        sink.write(self.cat_range(fs, path, start, stop, url))
        return None

    def cat_range(self, fs: Any, path: str, start: int, stop: int, url: str) -> bytes:
        """Bytes [start, stop): fewer where the object ends before `stop`, none where it ends
        before `start` (GCS and WebHDFS answer that with no bytes, S3 and HTTP with 416).
        More is a server that ignores ranges: BadRequestError (no retry helps)."""
        try:
            data: bytes = fs.cat_file(path, start=start, end=stop)
        except Exception as e:
            if status_of(root_cause(e)) == 416:
                return b""
            raise
        if len(data) > stop - start:  # the whole file, as `python -m http.server` sends: the shard is fine
            raise BadRequestError(
                f"{display(url)}: the server sent {len(data)} bytes for a range of {stop - start}: "
                "it ignores range requests, which streaming needs; serve the shards from one that "
                "supports them (nginx, S3, GCS) or copy them to local disk"
            )
        return data

    @contextlib.contextmanager
    def writer(self, url: str) -> Iterator[BinaryIO]:
        """On an object store an upload is visible only once complete: written in place, an
        error discards it. Elsewhere (HDFS: visible while written) written aside and renamed
        into place. Through a client with its own retries on: only it can retry an upload."""
        fs, path = filesystem(url, self.options)
        what = display(url)
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        target = path if protocols & OBJECT_STORES else f"{path}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        remote = retrying(what, lambda: fs.open(target, "wb"), 1)  # once: the client retries, a write is not idempotent
        try:
            yield cast(BinaryIO, Upload(remote, what))
            retrying(what, remote.close, 1)
            if target != path:
                retrying(what, lambda: _rename_into_place(fs, target, path, what), 1)
        except BaseException:
            _abandon(remote)
            if target != path:
                with contextlib.suppress(Exception):
                    fs.rm_file(target)
            raise

    def size_now(self, url: str) -> int:
        fs, path = self.client(url)
        fs.invalidate_cache(path)
        return int(fs.size(path))

    def cat(self, url: str) -> bytes:
        return cast(bytes, self.ask(url, _cat_whole))

    def open(self, url: str, what: str = "") -> BinaryIO:
        f = self.ask(url, lambda fs, path: fs.open(path, "rb", block_size=8 << 20), what)
        return cast(BinaryIO, RetriedFile(f, url, self, what))

    def info(self, url: str, what: str = "") -> dict[str, Any]:
        return cast(dict[str, Any], self.ask(url, lambda fs, path: fs.info(path), what))

    def ls(self, url: str, detail: bool) -> list[Any]:
        return cast(
            list[Any], self.ask(url, lambda fs, path: fs.ls(path.rstrip("/") if detail else path, detail=detail))
        )

    def find(self, url: str) -> dict[str, dict[str, Any]]:
        return cast(dict[str, dict[str, Any]], self.ask(url, lambda fs, path: fs.find(path.rstrip("/"), detail=True)))

    def remove(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ask(url, lambda fs, path: fs.rm_file(path))

    def makedirs(self, url: str) -> None:
        """fsspec's makedirs would create a bucket: a typo in its name would make a new one,
        so object stores are left alone (a write into a bucket that is not there fails, naming it)."""
        if scheme(url) not in OBJECT_STORES:
            self.ask(url, lambda fs, path: fs.makedirs(path, exist_ok=True))

    def remove_dir(self, url: str) -> None:
        if scheme(url) not in OBJECT_STORES:  # WebHDFS, HDFS: real folders (fsspec's rmdir is a no-op there)
            with contextlib.suppress(OSError, ShardkitError):
                self.ask(url, lambda fs, path: fs.rm(path, recursive=True) if not fs.ls(path) else None)


class WebHdfsStore(FsspecStore):
    name = "webhdfs"

    def cat_range(self, fs: Any, path: str, start: int, stop: int, url: str) -> bytes:
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


class GcsStore(FsspecStore):
    """gs://: gcsfs, as any fsspec backend, plus conditional writes (base.py): an upload or
    delete with `ifGenerationMatch` (0: only where there is none), which GCS answers 412
    when the object's generation is another. (The gcp-storage-emulator ignores it: the
    tests put a gate of GCS's rules in front of the emulator.)"""

    name = "gcs (gcsfs)"
    conditional_writes = True

    def _gcs(self, url: str, method: str, media: bool = False, **params: Any) -> Any:
        """One JSON API request on the object `url` (`media`: an upload of `data` or a
        download), retried as gcsfs does; None where GCS answered 412, or 404 other than
        for an upload's bucket."""
        fs, path = self.client(url)
        bucket, key, _ = fs.split_path(path)

        def call() -> Any:
            fs.invalidate_cache(path)
            try:
                if method == "POST":  # an upload, its data as the request's body
                    return fs.call(
                        "POST",
                        f"{fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
                        uploadType="media",
                        name=key,
                        json_out=True,
                        headers={"Content-Type": "application/octet-stream"},
                        **params,
                    )
                out = fs.call(method, "b/{}/o/{}", bucket, key, json_out=not media and method == "GET", **params)
                return out[1] if media else out
            except FileExistsError:  # gcsfs's 412: the generation is another
                return None
            except FileNotFoundError:
                if method == "POST":
                    raise  # no such bucket
                return None

        return self.retried(url, "", call)

    def read_versioned(self, url: str) -> tuple[bytes, str] | None:
        # its generation first, then the bytes of that generation: never a version newer than the bytes
        meta = self._gcs(url, "GET")
        if meta is None:
            return None
        data = self._gcs(url, "GET", media=True, alt="media", generation=meta["generation"])
        return None if data is None else (bytes(data), str(meta["generation"]))

    def put_if_absent(self, url: str, data: bytes) -> str | None:
        return self._upload(url, data, "0")

    def replace_if(self, url: str, data: bytes, version: str) -> str | None:
        return self._upload(url, data, version)

    def _upload(self, url: str, data: bytes, generation: str) -> str | None:
        made = self._gcs(url, "POST", ifGenerationMatch=generation, data=data)
        return None if made is None else str(made["generation"])

    def remove_if(self, url: str, version: str) -> bool:
        return self._gcs(url, "DELETE", ifGenerationMatch=version) is not None


def _cat_whole(fs: Any, path: str) -> bytes:
    """A remote file's bytes in one request: s3fs asks an object's size first (a HEAD, one
    round trip more for every index.json read) unless told to read it in one piece."""
    if "max_concurrency" in inspect.signature(fs.cat_file).parameters:
        return cast(bytes, fs.cat_file(path, max_concurrency=1))
    return cast(bytes, fs.cat_file(path))


class RetriedFile:
    """A remote file open for reading (`read` only), its reads retried like every request."""

    def __init__(self, f: Any, url: str, store: Store, what: str = ""):
        self._f, self._url, self._store, self._what = f, url, store, what

    def read(self, n: int = -1) -> bytes:
        # a failed read leaves fsspec's file (or s3_http's Body) where it was: the retry asks for the same bytes
        return cast(bytes, self._store.retried(self._url, self._what, lambda: self._f.read(n)))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RetriedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Upload:
    """The file an upload is written through (`write` only): a client's failure becomes one
    line naming the URL."""

    def __init__(self, f: Any, what: str):
        self._f, self._what = f, what

    def write(self, data: bytes) -> int:
        return cast(int, retrying(self._what, lambda: self._f.write(data), 1))


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
