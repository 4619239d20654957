"""Resolve what a user points at (a dataset folder, a brace pattern, a list of shards) into
shard URLs plus an Index. Shards without an index (webdataset's ShardWriter, plain `tar`)
are scanned once to learn their sample counts and offsets."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from . import index, storage
from .errors import DatasetNotFoundError
from .formats import lmdb as lmdb_format
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


@dataclass(frozen=True)
class ShardScan:
    info: ShardInfo
    fields: frozenset[str]


def scan_shard(url: str, storage_options: StorageOptions | None = None) -> ShardScan:
    """Read a whole shard: sample count, offsets, fields, size and sha256."""
    with storage.open_read(url, storage_options) as f:
        h = _Hashing(f)
        found = tar.scan(h, url)
        h.drain()
    info = ShardInfo(url.rsplit("/", 1)[-1], len(found.keys), h.count, h.sha.hexdigest(), tuple(found.offsets))
    return ShardScan(info, frozenset(found.fields))


def build_index(urls: Sequence[str], storage_options: StorageOptions | None = None) -> Index:
    """An Index for shards written by any tool (shard names are the URLs' base names)."""
    scans = [scan_shard(u, storage_options) for u in urls]
    return Index(shards=tuple(s.info for s in scans), fields=tuple(sorted(set().union(*(s.fields for s in scans)))))


def shard_urls(url: str, storage_options: StorageOptions | None = None) -> list[str]:
    """The .tar files directly under a folder or prefix, sorted."""
    names = [n for n in storage.listdir(url, storage_options) if n.endswith(".tar")]
    if not names:
        raise DatasetNotFoundError(f"{url}: no index.json and no .tar shards")
    return [storage.join(url, n) for n in names]


def expand(pattern: str) -> list[str]:
    """Bash-style braces, as webdataset takes them: shards-{000000..000009}.tar."""
    from braceexpand import braceexpand

    return list(braceexpand(pattern))


def resolve(source: str | Sequence[str], storage_options: StorageOptions | None = None) -> tuple[list[str], Index]:
    """(shard URLs, Index) for a dataset folder, a brace pattern or a list of shard URLs.
    An LMDB dataset resolves to its folder as the one "shard"."""
    if isinstance(source, str) and not source.endswith(".tar") and "{" not in source:
        try:
            idx = index.load(source, storage_options)  # one read, no existence check first
        except DatasetNotFoundError:
            pass
        else:
            if idx.kind == "lmdb":
                return [source], idx
            return [storage.join(source, s.name) for s in idx.shards], idx
        if storage.is_local(source) and lmdb_format.is_lmdb(storage.local_path(source)):
            return [source], lmdb_index(source)
        urls = shard_urls(source, storage_options)
    elif isinstance(source, str):
        urls = expand(source)
    else:
        urls = [str(u) for u in source]
    if not urls:
        raise DatasetNotFoundError(f"{source!r}: no shards given")
    for u in urls:
        if not storage.exists(u, storage_options):
            raise DatasetNotFoundError(f"{u}: no such shard")
    return urls, build_index(urls, storage_options)


def lmdb_index(path: str) -> Index:
    """The index stored inside a local LMDB dataset."""
    env = lmdb_format.open_reader(storage.local_path(path))
    return Index.from_json(lmdb_format.read_index(env, path), f"{path} ({lmdb_format.INDEX_KEY.decode()})")


def local_lmdb(url: str, storage_options: StorageOptions | None, cache_dir: str | None) -> str:
    """A local path for the LMDB dataset at `url`: itself when local, else a copy of its
    data.mdb downloaded (with a progress bar) into `cache_dir` (default: a temp folder),
    renamed into place when complete and reused on later runs."""
    if storage.is_local(url):
        return storage.local_path(url)
    import hashlib
    import os
    import tempfile

    from tqdm import tqdm

    root = os.path.join(cache_dir or os.path.join(tempfile.gettempdir(), "shardkit-cache"),
                        "lmdb-" + hashlib.sha256(url.encode()).hexdigest()[:24])
    if os.path.isfile(os.path.join(root, "data.mdb")):
        return root
    tmp = f"{root}{storage.TMP_MARK}{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    remote = storage.join(url, "data.mdb")
    total = storage.size(remote, storage_options)
    with storage.open_read(remote, storage_options) as src, open(os.path.join(tmp, "data.mdb"), "wb") as dst, \
            tqdm(total=total, unit="B", unit_scale=True, desc=f"copying {storage.display(remote)}") as bar:
        while chunk := src.read(8 << 20):
            dst.write(chunk)
            bar.update(len(chunk))
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return root
