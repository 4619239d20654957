"""Re-read shards: check them against the index, or build an index for shards made by
other tools (webdataset's ShardWriter, plain `tar`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import BinaryIO

from . import index, storage
from .errors import DatasetNotFoundError, ShardkitError
from .formats import tar
from .index import Index, ShardInfo
from .storage import StorageOptions


class _Hashing:
    """A read-only file wrapper that hashes and counts every byte read through it."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.sha = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha.update(data)
        self.count += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def _scan_shard(url: str, storage_options: StorageOptions | None) -> tuple[tar.Scan, str, int]:
    """Scan a shard; also return its sha256 and size."""
    with storage.open_read(url, storage_options) as f:
        h = _Hashing(f)
        found = tar.scan(h, url)
        h.drain()
    return found, h.sha.hexdigest(), h.count


def verify(url: str, storage_options: StorageOptions | None = None,
           on_shard: Callable[[ShardInfo, str | None], None] | None = None) -> list[str]:
    """Re-read every shard of the dataset at `url`; return one line per problem (empty: all good).

    Checks each shard's size, sha256, sample count and sample offsets against index.json.
    `on_shard(info, problem)` is called after each shard (for progress output).
    """
    idx = index.load(url, storage_options)
    problems = []
    for info in idx.shards:
        shard_url = storage.join(url, info.name)
        problem = None
        try:
            found, sha, size = _scan_shard(shard_url, storage_options)
        except FileNotFoundError:
            problem = f"{shard_url}: missing"
        except ShardkitError as e:
            problem = str(e)
        else:
            if size != info.bytes:
                problem = f"{shard_url}: {size} bytes, index says {info.bytes}"
            elif info.sha256 is not None and sha != info.sha256:
                problem = f"{shard_url}: sha256 mismatch (shard changed or corrupt)"
            elif len(found.keys) != info.samples:
                problem = f"{shard_url}: {len(found.keys)} samples, index says {info.samples}"
            elif info.offsets is not None and tuple(found.offsets) != info.offsets:
                problem = f"{shard_url}: sample offsets differ from the index"
        if problem:
            problems.append(problem)
        if on_shard:
            on_shard(info, problem)
    return problems


def shard_urls(url: str, storage_options: StorageOptions | None = None) -> list[str]:
    """The .tar files directly under a folder or prefix, sorted."""
    names = [n for n in storage.listdir(url, storage_options) if n.endswith(".tar")]
    if not names:
        raise DatasetNotFoundError(f"{url}: no .tar shards found")
    return [storage.join(url, n) for n in names]


def build_index(url: str, storage_options: StorageOptions | None = None, classes: tuple[str, ...] = ()) -> Index:
    """Scan the shards under `url` (written by any tool) into an Index, without saving it."""
    shards = []
    fields: set[str] = set()
    for shard_url in shard_urls(url, storage_options):
        found, sha, size = _scan_shard(shard_url, storage_options)
        fields |= found.fields
        shards.append(ShardInfo(shard_url.rsplit("/", 1)[-1], len(found.keys), size, sha, tuple(found.offsets)))
    return Index(shards=tuple(shards), fields=tuple(sorted(fields)), classes=classes)
