"""One-shot operations on a URL (read, list, remove, ...), each through the URL's store
(stores/), retried."""

from __future__ import annotations

import os
import time
from typing import Any, BinaryIO

from ..errors import CorruptShardError
from . import fingerprint, latencies
from .clients import origin
from .fetch import first_answer
from .stores import store_for
from .urls import AZURE, GCS, HTTP, S3, WEBHDFS, StorageOptions, display, is_local, join, local_path, scheme
from .streams import Arriving

_SMALL = 64 << 10  # an object this small takes about its first byte's latency to read


def read_bytes(url: str, storage_options: StorageOptions | None = None) -> bytes:
    """A whole (small) object; how long a small one took is a first-byte latency of its store
    (latencies.py: a dataset's index read times its workers' first hedges)."""
    return _whole(url, storage_options, hedged=False)


def read_hedged(url: str, storage_options: StorageOptions | None = None) -> bytes:
    """`read_bytes`, a remote object's read hedged (fetch.first_answer): for the few small
    reads in a row that open a dataset (its index, its offsets file), each a round trip in
    the latency tail's way before the first batch."""
    return _whole(url, storage_options, hedged=True)


def _whole(url: str, storage_options: StorageOptions | None, hedged: bool) -> bytes:
    store = store_for(url, storage_options)
    started = time.perf_counter()
    data = first_answer(store, url, lambda: store.cat(url)) if hedged and not is_local(url) else store.cat(url)
    if len(data) <= _SMALL and not is_local(url):
        latencies.record(store.name, origin(url, store.options), time.perf_counter() - started)
    return data


def read_range(url: str, start: int, stop: int, storage_options: StorageOptions | None = None) -> bytes:
    """Bytes [start, stop) of a file."""
    store = store_for(url, storage_options)

    def attempt() -> bytes:  # each into a buffer of its own: a retry asks for the whole range again
        into = Arriving(start, stop)
        store.get(url, start, stop, into, None)
        into.finish()
        data = into.data()
        into.release()
        return data

    data: bytes = store.retried_get(url, "", attempt)
    if len(data) != stop - start:
        raise CorruptShardError(f"{display(url)}: {len(data)} bytes at offset {start}, expected {stop - start}")
    return data


def open_read(url: str, storage_options: StorageOptions | None = None) -> BinaryIO:
    """A binary file for sequential reading."""
    return store_for(url, storage_options).open(url)


def exists(url: str, storage_options: StorageOptions | None = None) -> bool:
    try:  # fsspec's exists() answers False to any error: a refused or failed request included
        store_for(url, storage_options).info(url)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def size(url: str, storage_options: StorageOptions | None = None) -> int | None:
    """Size in bytes, or None if the object does not exist."""
    try:
        return int(store_for(url, storage_options).info(url)["size"])
    except FileNotFoundError:
        return None


_VERSION_MARKS = (
    "ETag",
    "etag",
    "generation",
    "VersionId",
    "md5Hash",
    "LastModified",
    "Last-Modified",
    "modificationTime",
    "mtime",
    "updated",
)  # S3, GCS, HTTP, WebHDFS


def version(url: str, storage_options: StorageOptions | None = None) -> tuple[int, str]:
    """(size, mark) of a remote object, the mark being what its store changes when it is
    replaced: its ETag, generation or modification time."""
    info = store_for(url, storage_options).info(url)
    return int(info["size"]), next((str(info[k]) for k in _VERSION_MARKS if info.get(k)), "")


def pin_of(url: str, info: dict[str, Any]) -> dict[str, Any] | None:
    """What the store changes when the object `url` is replaced, from its details (fsspec's
    info or listing): S3's and Azure's ETag, GCS's generation, WebHDFS's modification time, an HTTP
    server's ETag, else its Last-Modified (a presigned URL's answer carries the object's
    ETag); None where the store gives none of them."""
    if scheme(url) in S3 and info.get("ETag"):
        return {"etag": str(info["ETag"])}
    if scheme(url) in AZURE and info.get("etag"):  # adlfs's, quoted as Azure sends it
        return {"etag": str(info["etag"])}
    if scheme(url) in GCS and info.get("generation"):
        return {"generation": str(info["generation"])}
    if scheme(url) in WEBHDFS and info.get("modificationTime"):
        return {"mtime_ns": int(info["modificationTime"]) * 1_000_000}
    if scheme(url) in HTTP:
        if info.get("ETag"):
            return {"etag": str(info["ETag"])}
        if info.get("Last-Modified"):
            return {"last_modified": str(info["Last-Modified"])}
    return None


def pin_now(url: str, storage_options: StorageOptions | None = None) -> tuple[int, dict[str, Any] | None]:
    """(size, pin) of one shard, asked now: its store's version (`pin_of`), else its
    fingerprint (a local file's always: fingerprint.py says why); FileNotFoundError where it
    is not there."""
    if is_local(url):
        path = local_path(url)
        return os.stat(path).st_size, {fingerprint.MARK: fingerprint.of_path(path)}
    info = store_for(url, storage_options).info(url)
    size = int(info["size"])
    return size, pin_of(url, info) or _fingerprinted(url, size, storage_options)


def pins(url: str, names: list[str], storage_options: StorageOptions | None = None) -> list[dict[str, Any] | None]:
    """The pin of each file `names` directly under the folder `url`: its store's version
    (`pin_of`) from one listing (over HTTP, whose listings are pages of links, from each
    file's own answer), else its fingerprint (local files, stores that keep no version);
    None for one not found."""
    if is_local(url):
        return [_pin_or_none(join(url, n), storage_options) for n in names]
    if scheme(url) in HTTP:
        return [_pin_or_none(join(url, n), storage_options) for n in names]
    try:
        found = store_for(url, storage_options).ls(url, detail=True)
    except FileNotFoundError:
        found = []
    listing = {info["name"].rstrip("/").rsplit("/", 1)[-1]: info for info in found}
    return [
        None
        if n not in listing
        else pin_of(url, listing[n]) or _fingerprinted(join(url, n), int(listing[n]["size"]), storage_options)
        for n in names
    ]


def _fingerprinted(url: str, size: int, storage_options: StorageOptions | None) -> dict[str, Any]:
    """The pin of a remote object whose store gives no version: its fingerprint, one ranged read."""
    return {fingerprint.MARK: fingerprint.fingerprint(size, lambda a, b: read_range(url, a, b, storage_options))}


def _pin_or_none(url: str, storage_options: StorageOptions | None) -> dict[str, Any] | None:
    try:
        return pin_now(url, storage_options)[1]
    except FileNotFoundError:
        return None


def find(url: str, storage_options: StorageOptions | None = None) -> dict[str, dict[str, Any]]:
    """Every object under a remote prefix, recursively, with its details: {path: info};
    empty where there is none."""
    try:
        return store_for(url, storage_options).find(url)
    except FileNotFoundError:
        return {}


def listdir(url: str, storage_options: StorageOptions | None = None) -> list[str]:
    """Base names directly under a directory or prefix; [] if it does not exist."""
    try:
        paths = store_for(url, storage_options).ls(url, detail=False)
    except FileNotFoundError:
        return []
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in paths)


def remove(url: str, storage_options: StorageOptions | None = None) -> None:
    store_for(url, storage_options).remove(url)


def makedirs(url: str, storage_options: StorageOptions | None = None) -> None:
    """Make the folder `url` (object stores have none to make)."""
    store_for(url, storage_options).makedirs(url)


def remove_dir(url: str, storage_options: StorageOptions | None = None) -> None:
    """Remove an empty directory (a no-op on object stores, which have none); best effort."""
    store_for(url, storage_options).remove_dir(url)
