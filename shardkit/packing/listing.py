"""A pack's items, in the order the scan found them, kept compact.

A Listing keeps its items in numpy arrays and one bytes blob of paths (about 70 bytes per
file), not as Python objects (about 450 bytes each): a million files cost ~70 MB to plan.
A sample's sidecars and values (see sidecars.py) are a second blob, absent when no item has
any.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np


class Item(NamedTuple):
    key: str  # output sample key ("" keeps the source's own key)
    path: str  # folder: path relative to SRC, '/'-separated; tar: "SHARD@START:END"; lmdb: the key
    label: int  # class index (-1: none, or the source sample carries its own)
    size: int
    mtime_ns: int  # or any change marker: a hash of a store's ETag, or of a sample's files (sidecars.marker)
    extras: str = ""  # its sidecars and values, sidecars.encode'd


@dataclass(frozen=True)
class Listing:
    paths: bytes  # every item's path, UTF-8, back to back
    ends: np.ndarray  # where each path ends in `paths`
    labels: np.ndarray
    sizes: np.ndarray
    mtimes: np.ndarray
    extras: bytes = b""  # every item's extras, UTF-8, back to back...
    extra_ends: np.ndarray | None = None  # ...ending here (None: no item has any)
    extra_sizes: np.ndarray | None = None  # the bytes each item's extras take in a tar shard
    extra_fields: tuple[str, ...] = ()  # the fields they give, sorted

    def __len__(self) -> int:
        return len(self.ends)

    def item(self, i: int, key: str = "") -> Item:
        path = _slice(self.paths, self.ends, i)
        extras = _slice(self.extras, self.extra_ends, i) if self.extra_ends is not None else ""
        return Item(key, path, int(self.labels[i]), int(self.sizes[i]), int(self.mtimes[i]), extras)


def _slice(blob: bytes, ends: np.ndarray, i: int) -> str:
    start = int(ends[i - 1]) if i else 0
    return blob[start : int(ends[i])].decode("utf-8")


class ListingBuilder:
    def __init__(self) -> None:
        self.paths, self.extras = bytearray(), bytearray()
        self.ends, self.labels, self.sizes, self.mtimes = array("q"), array("q"), array("q"), array("q")
        self.extra_ends, self.extra_sizes = array("q"), array("q")
        self.fields: set[str] = set()

    def add(
        self,
        path: str,
        label: int,
        size: int,
        mtime: int,
        extras: str = "",
        extra_size: int = 0,
        fields: tuple[str, ...] = (),
    ) -> None:
        """One item; `extras` take `extra_size` bytes in a tar shard and give `fields`."""
        self.paths += path.encode("utf-8")
        self.ends.append(len(self.paths))
        self.labels.append(label)
        self.sizes.append(size)
        self.mtimes.append(mtime)
        self.extras += extras.encode("utf-8")
        self.extra_ends.append(len(self.extras))
        self.extra_sizes.append(extra_size)
        self.fields.update(fields)

    def build(self) -> Listing:
        def column(a: array[int]) -> np.ndarray:
            return np.frombuffer(a, np.int64)

        listing = Listing(
            bytes(self.paths), column(self.ends), column(self.labels), column(self.sizes), column(self.mtimes)
        )
        if not self.extras:
            return listing
        return Listing(
            listing.paths,
            listing.ends,
            listing.labels,
            listing.sizes,
            listing.mtimes,
            bytes(self.extras),
            column(self.extra_ends),
            column(self.extra_sizes),
            tuple(sorted(self.fields)),
        )


def change_marker(info: dict[str, Any]) -> int:
    """What tells a changed object in a store's listing: object stores give no mtime in
    nanoseconds, but an ETag (or a generation, a modification time) will do, hashed."""
    marker = str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime") or "")
    return int.from_bytes(hashlib.sha256(marker.encode()).digest()[:7], "big")
