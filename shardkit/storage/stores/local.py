"""Local disk (plain paths and file:// URLs), through os calls: no fsspec in the way.

Conditional writes (base.py) hold to the same rules as on object stores: a new object is
written aside and hard-linked into place (link(2) fails where a file is there, so no reader
sees half of it); a replace or remove locks the file there (flock), checks that it is still
the version read (its inode and modification time), then renames over it or removes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, cast

from ...errors import name_file
from ..seqwrite import SequentialWriter
from ..urls import local_path
from .base import TMP_MARK, Sink, Store


class LocalStore(Store):
    name = "local"
    conditional = True  # nothing to pin: a local file's mtime changes with every plain copy

    def retried(self, url: str, what: str, fn: Callable[[], Any], throttled: Callable[[], None] | None = None) -> Any:
        return fn()  # a local disk's error is not worth a wait and another try

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        fd = os.open(local_path(url), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            at = start
            while at < stop and (data := os.pread(fd, min(stop - at, 8 << 20), at)):
                sink.write(data)
                at += len(data)
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def writer(self, url: str) -> Iterator[BinaryIO]:
        """`url.tmp-<random>` (direct I/O where the file system allows it, seqwrite.py),
        flushed, renamed into place and the rename made durable; on error removed."""
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

    def size_now(self, url: str) -> int:
        return os.stat(local_path(url)).st_size

    def cat(self, url: str) -> bytes:
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

    def open(self, url: str, what: str = "") -> BinaryIO:
        return open(local_path(url), "rb", buffering=1 << 20)

    def info(self, url: str, what: str = "") -> dict[str, Any]:
        st = os.stat(local_path(url))
        return {"name": local_path(url), "size": st.st_size, "mtime": st.st_mtime}

    def ls(self, url: str, detail: bool) -> list[Any]:
        try:
            names = sorted(os.listdir(local_path(url)))
        except NotADirectoryError:
            return []
        return [self.info(os.path.join(local_path(url), n)) for n in names] if detail else names

    def find(self, url: str) -> dict[str, dict[str, Any]]:
        found = {}
        for folder, _, names in os.walk(local_path(url)):
            for n in names:
                path = os.path.join(folder, n)
                found[path] = self.info(path)
        return found

    def remove(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(local_path(url))

    def makedirs(self, url: str) -> None:
        os.makedirs(local_path(url), exist_ok=True)

    def remove_dir(self, url: str) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(local_path(url))

    conditional_writes = True

    def read_versioned(self, url: str) -> tuple[bytes, str] | None:
        try:
            fd = os.open(local_path(url), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
            return data, _version(os.fstat(fd))
        finally:
            os.close(fd)

    def put_if_absent(self, url: str, data: bytes) -> str | None:
        path = local_path(url)
        tmp = _written_aside(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        finally:
            os.remove(tmp)
        return _version(os.stat(path))

    def replace_if(self, url: str, data: bytes, version: str) -> str | None:
        path = local_path(url)
        with _locked_at(path, version) as there:
            if not there:
                return None
            tmp = _written_aside(path, data)
            new = _version(os.stat(tmp))
            os.replace(tmp, path)
            return new

    def remove_if(self, url: str, version: str) -> bool:
        path = local_path(url)
        with _locked_at(path, version) as there:
            if there:
                os.remove(path)
            return there


def _version(st: os.stat_result) -> str:
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


def _written_aside(path: str, data: bytes) -> str:
    """A new file beside `path` holding `data`, on disk."""
    tmp = f"{path}.new-{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.remove(tmp)
        raise
    finally:
        os.close(fd)
    return tmp


@contextlib.contextmanager
def _locked_at(path: str, version: str) -> Iterator[bool]:
    """Hold the file at `path` locked; whether it is still `version` (False: it changed or went)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            yield False
            return
        mine = os.fstat(fd)
        yield (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino) and _version(mine) == version
    finally:
        os.close(fd)


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
