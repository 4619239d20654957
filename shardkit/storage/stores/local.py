"""Local disk (plain paths and file:// URLs), through os calls: no fsspec in the way."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, BinaryIO

from ...errors import name_file
from ..urls import local_path
from .base import Sink, Store


class LocalStore(Store):
    name = "local"
    conditional = True  # nothing to pin: a local file's mtime changes with every plain copy

    def retried(self, url: str, what: str, fn: Callable[[], Any]) -> Any:
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
