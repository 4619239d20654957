"""index.json in a dataset's folder: finding, loading and saving it (with its offsets
file), and the shards' current versions."""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from .. import formats, storage
from ..errors import DatasetNotFoundError, ShardkitError, UnfinishedPackError
from ..formats.lmdb import DATA_FILE as LMDB_DATA_FILE
from ..storage import StorageOptions
from . import offsets
from .model import INDEX_NAME, PROGRESS_DIR, SHARD_SUFFIXES, Index, OffsetsFile, check_names


def pinned(index: Index, url: str, storage_options: StorageOptions | None = None) -> Index:
    """`index` with each shard's current version (one listing of the dataset's folder), for
    readers to check; a tar index only (an LMDB is read from a local copy)."""
    if not formats.get(index.kind).sharded:
        return index
    return with_pins(index, storage.pins(url, [s.name for s in index.shards], storage_options))


def with_pins(index: Index, found: Sequence[dict[str, Any] | None]) -> Index:
    """`index` with its shards' versions `found` (storage.pins, in the shards' order)."""
    return replace(index, shards=tuple(replace(s, version=v) for s, v in zip(index.shards, found)))


def find(url: str, storage_options: StorageOptions | None = None) -> Index | None:
    """DATASET/index.json, or None where there is none (an unfinished pack raises)."""
    where = storage.join(url, INDEX_NAME)
    try:
        text = storage.read_hedged(where, storage_options)
    except FileNotFoundError:
        check_finished(url, storage_options)
        return None
    except NotADirectoryError:
        raise DatasetNotFoundError(f"{url}: not a folder (give the dataset folder, which holds {INDEX_NAME})") from None
    index = Index.from_json(text, where)
    return replace(index, offsets_file=replace(index.offsets_file, folder=url)) if index.offsets_file else index


def load(url: str, storage_options: StorageOptions | None = None) -> Index:
    """Read DATASET/index.json; where there is none, say what the folder may be instead."""
    found = find(url, storage_options)
    if found is None and storage.is_local(url) and not os.path.isdir(storage.local_path(url)):
        raise DatasetNotFoundError(f"{url}: no such folder")  # the readers' words for it
    if found is None:
        raise DatasetNotFoundError(f"{storage.join(url, INDEX_NAME)}: no such index ({_guess(url, storage_options)})")
    return found


def check_finished(url: str, storage_options: StorageOptions | None = None) -> None:
    """Raise UnfinishedPackError where a pack into `url` has started and not finished: its
    shards must not be read (or indexed) as if they were a dataset."""
    if storage.exists(storage.join(url, PROGRESS_DIR), storage_options):
        raise UnfinishedPackError(
            f"{storage.join(url, INDEX_NAME)}: not written yet: a pack into "
            f"{storage.display(url)} has not finished (rerun the same `shardkit pack` to finish it)"
        )


def _guess(url: str, storage_options: StorageOptions | None) -> str:
    """What a folder without index.json may be, by its listing (asked only on that failure)."""
    try:
        names = storage.listdir(url, storage_options)
    except (OSError, ShardkitError):
        names = []
    if LMDB_DATA_FILE in names:
        return "an LMDB pack that has not finished, or whose index.json was removed: rerun the same `shardkit pack`"
    if any(n.endswith(SHARD_SUFFIXES) for n in names):
        return f"tar shards from another tool: `shardkit index {storage.display(url)}` writes one"
    return "not a shardkit dataset?"


def save(index: Index, url: str, storage_options: StorageOptions | None = None, tidy: bool = True) -> Index:
    """Write DATASET/index.json atomically (one that a reader would refuse is refused here),
    after the offsets file of its tar shards; then (`tidy`) remove other offsets files.
    Returns the index as saved."""
    check_names(index, storage.join(url, INDEX_NAME))
    if formats.get(index.kind).sharded and index.offsets_file is None:
        tables = [s.offsets for s in index.shards]
        if any(t is None for t in tables):
            raise ShardkitError(f"{storage.join(url, INDEX_NAME)}: not saved: shards without sample offsets")
        index = with_offsets_file(index, url, tables, storage_options)
    storage.write_bytes_atomic(storage.join(url, INDEX_NAME), index.to_json().encode(), storage_options)
    if tidy:
        keep = index.offsets_file.file if index.offsets_file else None
        for name in storage.listdir(url, storage_options):
            if offsets.PATTERN.match(name) and name != keep:
                storage.remove(storage.join(url, name), storage_options)
    return index


def with_offsets_file(
    index: Index, url: str, tables: Iterable[Any], storage_options: StorageOptions | None = None
) -> Index:
    """`index`, its shards' offset `tables` (one per shard, in order; a generator holds
    one at a time) written to its offsets file in the folder `url`, without them in the shards."""
    name = offsets.name_for((s.name, s.samples, s.bytes, s.sha256) for s in index.shards)
    sha = offsets.write(storage.join(url, name), tables, index.samples + len(index.shards), storage_options)
    return replace(
        index, shards=tuple(replace(s, offsets=None) for s in index.shards), offsets_file=OffsetsFile(name, sha, url)
    )


def sample_offsets(
    index: Index, storage_options: StorageOptions | None = None, cache_dir: str | None = None
) -> np.ndarray | offsets.Offsets:
    """Every shard's offset table back to back (see offsets.py): the offsets file mapped into
    memory (version 2), or the tables of the index's own shards (version 1, shards scanned)."""
    if index.offsets_file is not None:
        return _open_offsets_file(index, index.offsets_file, storage_options, cache_dir)
    tables = [s.offsets for s in index.shards]
    lacking = next((s.name for s in index.shards if s.offsets is None), None)
    if lacking is not None:
        raise ShardkitError(f"{lacking}: the index lists no sample offsets; rebuild it with `shardkit index`")
    return np.concatenate([np.asarray(t, dtype=np.int64) for t in tables] or [np.empty(0, np.int64)])


def with_offsets(index: Index, storage_options: StorageOptions | None = None) -> Index:
    """`index` with each shard's offset table in its entry (tools that compare or copy
    shards one by one; a reader maps the offsets file instead)."""
    if index.offsets_file is None:
        return index
    table = _open_offsets_file(index, index.offsets_file, storage_options, None).array
    each = [array("q", t.tobytes()) for t in offsets.tables(table, [s.samples for s in index.shards])]
    return replace(index, shards=tuple(replace(s, offsets=t) for s, t in zip(index.shards, each)), offsets_file=None)


def _open_offsets_file(
    index: Index, side: OffsetsFile, storage_options: StorageOptions | None, cache_dir: str | None
) -> offsets.Offsets:
    return offsets.open_table(
        side.folder, side.file, side.sha256, index.samples + len(index.shards), storage_options, cache_dir
    )
