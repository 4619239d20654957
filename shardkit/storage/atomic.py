"""Atomic writes: a reader never sees half a file, locally or on an object store."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

from ..errors import ShardkitError, name_file
from .clients import filesystem
from .retry import retrying
from .seqwrite import SequentialWriter
from .stores.s3 import MultipartUpload
from .urls import S3, StorageOptions, OBJECT_STORES, display, is_local, local_path, scheme


TMP_MARK = ".tmp-"


@contextlib.contextmanager
def atomic_writer(url: str, storage_options: StorageOptions | None = None) -> Iterator[BinaryIO]:
    """A file that appears under `url` only once it is complete.

    Locally: write `url.tmp-<random>` (with direct I/O where the file system allows it, see
    seqwrite.py), fsync, rename into place; on error the temporary file is removed. On
    object stores an upload becomes visible only when it completes, so the object is written
    in place and an error aborts the upload; on S3 its parts go up several at once
    (stores/s3.py MultipartUpload).
    """
    if is_local(url):
        path = local_path(url)
        tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex[:12]}"
        f = SequentialWriter(tmp)
        try:
            try:
                yield cast(BinaryIO, f)  # it writes as a binary file does
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
    if scheme(url) in S3 and "::" not in url:  # parts sent in parallel: a capped connection is not the limit
        upload = MultipartUpload(fs, path)
        try:
            yield cast(BinaryIO, _Upload(upload, what))
            retrying(what, upload.close, 1)
        except BaseException:
            upload.abort()
            raise
        return
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & OBJECT_STORES:
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
