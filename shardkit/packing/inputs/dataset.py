"""A shardkit dataset to convert into another (or the same) format, its samples copied byte
for byte in its order with its keys. What its format is asked only through its traits
(formats.get): a sharded one's samples are byte ranges of its shards, by the offsets its
index holds; any other's are records by key, as its index lists them. A dataset read from
local files only is copied here whole first, where it is remote."""

from __future__ import annotations

from ... import formats, index, storage
from ...errors import SourceError
from ...index import Index
from ...index.resolve import dataset_index, local_lmdb
from ...storage import StorageOptions
from ..listing import Listing, ListingBuilder
from .kind import Kind, Scanned


def claims(src: str, storage_options: StorageOptions | None = None) -> str | None:
    """The format's name where SRC is a shardkit dataset (it has an index)."""
    found = dataset_index(src, storage_options)
    return None if found is None else found.kind


def scan(src: str, storage_options: StorageOptions | None, layout: str, fields: tuple[str, ...]) -> Scanned:
    """The dataset's samples as items to copy: a sharded one's path is "SHARD@START:END", any
    other's its sample key (`layout` and `fields` are an image folder's)."""
    idx = _found(src, storage_options)
    fmt = formats.get(idx.kind)
    if fmt.local_only and not storage.is_local(src):
        src = local_lmdb(src, storage_options, None)  # read from a whole local copy
        idx = _found(src, storage_options)
    if fmt.sharded:
        idx = index.with_offsets(idx, storage_options)
    return Scanned(src, idx.classes, _by_range(src, idx) if fmt.sharded else _by_key(idx), converted=idx)


def _found(src: str, storage_options: StorageOptions | None) -> Index:
    found = dataset_index(src, storage_options)
    if found is None:
        raise SourceError(f"{storage.display(src)}: no longer a shardkit dataset (its index is gone)")
    return found


def _by_key(idx: Index) -> Listing:
    found = ListingBuilder()
    keys = idx.extra.get("keys", [])
    for key, size in zip(keys, idx.extra.get("sizes") or [0] * len(keys)):
        found.add(key, -1, size, 0)
    return found.build()


def _by_range(src: str, idx: Index) -> Listing:
    found = ListingBuilder()
    for shard in idx.shards:
        if shard.offsets is None:
            raise SourceError(f"{storage.join(src, shard.name)}: index lacks sample offsets (run `shardkit index`)")
        for a, b in zip(shard.offsets, shard.offsets[1:]):
            found.add(f"{shard.name}@{a}:{b}", -1, b - a, 0)
    return found.build()


KIND = Kind(claims, scan, converts=True)
