"""Atomic writes: a reader never sees half a file, locally or on an object store. Each
store writes its own way (stores/: `Store.writer`); this is the one door to them."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import BinaryIO

from .stores import store_for
from .stores.base import TMP_MARK
from .urls import StorageOptions

__all__ = ["TMP_MARK", "atomic_writer", "write_bytes_atomic"]


def atomic_writer(url: str, storage_options: StorageOptions | None = None) -> AbstractContextManager[BinaryIO]:
    """A file that appears under `url` only once it is complete: locally written aside,
    flushed and renamed into place; on object stores an upload that becomes visible when it
    completes (on S3 its parts sent several at once). On error nothing new is left."""
    return store_for(url, storage_options).writer(url)


def write_bytes_atomic(url: str, data: bytes, storage_options: StorageOptions | None = None) -> None:
    with atomic_writer(url, storage_options) as f:
        f.write(data)
