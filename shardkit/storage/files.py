"""One-shot operations on a URL (read, list, remove, ...), each through the URL's store
(stores/), retried."""

from __future__ import annotations

from typing import Any, BinaryIO

from ..errors import CorruptShardError
from .stores import store_for
from .urls import AZURE, GCS, HTTP, S3, WEBHDFS, StorageOptions, display, is_local, join, scheme
from .streams import Arriving


def read_bytes(url: str, storage_options: StorageOptions | None = None) -> bytes:
    return store_for(url, storage_options).cat(url)


def read_range(url: str, start: int, stop: int, storage_options: StorageOptions | None = None) -> bytes:
    """Bytes [start, stop) of a file."""
    store = store_for(url, storage_options)
    into = Arriving(start, stop)
    store.retried(url, "", lambda: store.get(url, start, stop, into, None))
    data = into.data()
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


_VERSION_MARKS = ("ETag", "etag", "generation", "VersionId", "md5Hash", "LastModified", "Last-Modified",
                  "modificationTime", "mtime", "updated")  # S3, GCS, HTTP, WebHDFS


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
    """(size, version) of one remote object, asked now (its version None where its store
    gives none, or for a local file); FileNotFoundError where it is not there."""
    info = store_for(url, storage_options).info(url)
    return int(info["size"]), None if is_local(url) else pin_of(url, info)


def pins(url: str, names: list[str], storage_options: StorageOptions | None = None) -> list[dict[str, Any] | None]:
    """The version (`pin_of`) of each file `names` directly under the folder `url`, from one
    listing (over HTTP, whose listings are pages of links, from each file's own answer);
    None for one not found, and for local files: their modification time changes with every
    plain copy (a copied dataset would fail every read) and would make index.json differ
    between two packs of the same input."""
    if is_local(url):
        return [None] * len(names)
    if scheme(url) in HTTP:
        return [_pin_or_none(join(url, n), storage_options) for n in names]
    try:
        found = store_for(url, storage_options).ls(url, detail=True)
    except FileNotFoundError:
        found = []
    listing = {info["name"].rstrip("/").rsplit("/", 1)[-1]: info for info in found}
    return [pin_of(url, listing[n]) if n in listing else None for n in names]


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
