"""Resolve what a user points at (a dataset folder, a brace pattern, a list of shards) into
shard URLs plus an Index. Shards without an index (webdataset's ShardWriter, plain `tar`)
are scanned once to learn their sample counts and offsets."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import BinaryIO

from .. import checks, formats, index, storage
from ..errors import (
    AccessDeniedError,
    BadRequestError,
    CorruptShardError,
    DatasetNotFoundError,
    IndexVersionError,
    ShardkitError,
    UnfinishedPackError,
)
from ..formats import gzip, tar
from ..formats import lmdb as lmdb_format
from .model import Index, ShardInfo
from ..storage import StorageOptions, cache


class _Hashing:
    """A read-only file wrapper that hashes and counts every byte read through it (and
    hands it to `copy_to`, if given)."""

    def __init__(self, f: BinaryIO, copy_to: Callable[[bytes], object] | None = None):
        self._f, self._copy_to = f, copy_to
        self.sha = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha.update(data)
        self.count += len(data)
        if self._copy_to is not None:
            self._copy_to(data)
        return data

    def drain(self) -> None:
        while self.read(8 << 20):
            pass


@dataclass(frozen=True)
class ShardScan:
    info: ShardInfo
    fields: frozenset[str]


def scan_shard(
    url: str, storage_options: StorageOptions | None = None, copy_to: Callable[[bytes], object] | None = None
) -> ShardScan:
    """Read a whole shard: sample count, offsets, fields, size and sha256 (its bytes
    handed to `copy_to` too, if given). A gzip-compressed one (told by its first bytes) is
    inflated as it is read, to its end: its CRC checked."""
    with storage.open_read(url, storage_options) as f:
        h = _Hashing(f, copy_to)
        stream, compressed = gzip.open_stream(h, storage.display(url))
        found = tar.scan(stream, url)
        while stream.read(8 << 20):
            pass
        h.drain()
    if not h.count:  # what a failed copy leaves; tar and Python's tarfile refuse it too
        raise CorruptShardError(f"{storage.display(url)}: an empty file (0 bytes), not a tar archive")
    info = ShardInfo(
        url.rsplit("/", 1)[-1],
        len(found.keys),
        h.count,
        h.sha.hexdigest(),
        tuple(found.offsets),
        "gzip" if compressed else None,
    )
    return ShardScan(info, frozenset(found.fields))


def shard_digest(
    url: str, storage_options: StorageOptions | None = None, copy_to: Callable[[bytes], object] | None = None
) -> tuple[int, str]:
    """A whole shard's size and sha256, without parsing it (its bytes handed to `copy_to`
    too, if given)."""
    with storage.open_read(url, storage_options) as f:
        h = _Hashing(f, copy_to)
        h.drain()
    return h.count, h.sha.hexdigest()


def build_index(urls: Sequence[str], storage_options: StorageOptions | None = None) -> Index:
    """An Index for shards written by any tool (shard names are the URLs' base names); each
    shard is read whole once.

    Args:
        urls: a list of shard paths or URLs, or one str, a brace pattern included.
        storage_options: passed to fsspec unchanged.
    """
    if isinstance(urls, (str, os.PathLike)):
        urls = expand(checks.path("urls", urls))
    urls = [checks.path("each of urls", u) for u in urls]
    if not urls:
        raise ValueError("build_index needs at least one shard")
    scans = [scan_shard(u, storage_options) for u in urls]
    return Index(shards=tuple(s.info for s in scans), fields=tuple(sorted(set().union(*(s.fields for s in scans)))))


def shard_urls(url: str, storage_options: StorageOptions | None = None) -> list[str]:
    """The tar files (.tar, .tar.gz, .tgz) directly under a folder or prefix, sorted."""
    names = [n for n in storage.listdir(url, storage_options) if n.endswith(index.SHARD_SUFFIXES)]
    if not names:
        if storage.is_local(url) and not os.path.isdir(storage.local_path(url)):
            raise DatasetNotFoundError(f"{url}: no such folder")
        raise DatasetNotFoundError(
            f"{url}: no index.json and no .tar shards (an image folder? `shardkit pack` it first)"
        )
    return [storage.join(url, n) for n in names]


def expand(pattern: str) -> list[str]:
    """Bash-style braces, as webdataset takes them: shards-{000000..000009}.tar."""
    from braceexpand import braceexpand

    return list(braceexpand(pattern))


def resolve(source: str | Iterable[str], storage_options: StorageOptions | None = None) -> tuple[list[str], Index]:
    """(shard URLs, Index) for a dataset folder, a brace pattern or a list of shard URLs.
    An LMDB dataset resolves to its folder as the one "shard"."""
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    data = sys.modules.get("torch.utils.data")  # a dataset is iterable too: never read through as a list of URLs
    if (
        not isinstance(source, (str, Iterable))
        or isinstance(source, (bytes, bytearray))
        or (data is not None and isinstance(source, data.Dataset))
    ):
        raise TypeError(
            f"source must be a dataset folder or URL, a brace pattern or a list of shard paths or URLs, "
            f"not a {type(source).__name__}"
        )
    if isinstance(source, str) and not source.endswith(index.SHARD_SUFFIXES) and "{" not in source:
        try:
            idx = index.find(source, storage_options)  # one read, no existence check first
        except UnfinishedPackError:
            raise  # its shards are not a dataset yet
        except DatasetNotFoundError:  # not a folder
            idx = None
        if idx is not None:
            if not formats.get(idx.kind).sharded:  # one database: its folder is the one "shard"
                return [source], idx
            folder = storage.join(source, "")
            return [folder + s.name for s in idx.shards], idx
        if storage.is_local(source) and lmdb_format.is_lmdb(storage.local_path(source)):
            return [source], lmdb_index(source)
        urls = shard_urls(source, storage_options)
    elif isinstance(source, str):
        urls = expand(source)
    else:
        urls = [checks.path("each shard of source", u) for u in source]
    if not urls:
        raise DatasetNotFoundError(f"{source!r}: no shards given")
    return urls, _index_of(urls, storage_options)


def _index_of(urls: list[str], storage_options: StorageOptions | None) -> Index:
    """An Index for a list of shards: a shard that the index.json of its folder lists, at
    the size it has, is taken from there (building stays one read per folder, not a read
    of every byte); any other is scanned. Each remote shard's version (ETag, generation,
    Last-Modified) is the one it has now, unless that index recorded one: a reader checks
    it, so a shard replaced behind its URL since (a presigned HTTPS URL's included) fails
    at its first read rather than being read silently."""
    folders: dict[str, tuple[Index, dict[str, ShardInfo]] | None] = {}
    used: set[str] = set()
    infos: list[ShardInfo] = []
    fields: set[str] = set()
    scanned = 0
    for u in urls:
        try:  # its version now, before its bytes are scanned: a reader checks the shard is still this one
            size, pin = storage.pin_now(u, storage_options)
        except FileNotFoundError:
            raise DatasetNotFoundError(f"{u}: no such shard") from None
        folder, _, name = u.rpartition("/")
        if folder not in folders:
            idx = _tar_index(folder or ".", storage_options)
            folders[folder] = None if idx is None else (idx, {sh.name: sh for sh in idx.shards})
        listed = folders[folder]
        known = listed[1].get(name) if listed is not None else None
        if known is not None and known.bytes == size and known.offsets is not None:
            infos.append(known if known.version is not None else replace(known, version=pin))
            used.add(folder)
        else:
            found = scan_shard(u, storage_options)
            infos.append(replace(found.info, version=pin))
            fields |= found.fields
            scanned += 1
    indexes = [listed[0] for f in used if (listed := folders[f]) is not None]  # (used: listed ones only)
    for idx in indexes:
        fields |= set(idx.fields)
    classes = indexes[0].classes if len(indexes) == 1 and not scanned else ()  # its labels' names
    return Index(shards=tuple(infos), fields=tuple(sorted(fields)), classes=classes)


def _tar_index(folder: str, storage_options: StorageOptions | None) -> Index | None:
    """The index.json of a folder of tar shards, if it has a usable one (None: its shards are
    scanned). A store that keeps failing raises: a scan would read every shard whole, from it."""
    try:
        idx = index.find(folder, storage_options)
    except (CorruptShardError, IndexVersionError, DatasetNotFoundError, AccessDeniedError, BadRequestError, OSError):
        return None  # none usable, a pack into it unfinished, or not ours to read (signed shard URLs)
    return index.with_offsets(idx, storage_options) if idx is not None and formats.get(idx.kind).sharded else None


def dataset_index(src: str, storage_options: StorageOptions | None = None) -> Index | None:
    """The index of the shardkit dataset at `src`: its index.json, or the one a local LMDB
    holds inside (None: neither, so no dataset of ours)."""
    if storage.exists(storage.join(src, index.INDEX_NAME), storage_options):
        return index.load(src, storage_options)
    if storage.is_local(src) and lmdb_format.is_lmdb(storage.local_path(src)):
        return lmdb_index(src)
    return None


def lmdb_index(path: str, readahead: bool = False) -> Index:
    """The index stored inside a local LMDB dataset (opening it with `readahead`)."""
    env = lmdb_format.open_reader(storage.local_path(path), readahead, fresh=True)
    return Index.from_json(lmdb_format.read_index(env, path), f"{path} ({lmdb_format.INDEX_KEY.decode()})")


def local_lmdb(
    url: str, storage_options: StorageOptions | None, cache_dir: str | None, cache_limit: int | None = None
) -> str:
    """A local path for the LMDB dataset at `url`: itself when local, else a copy of its
    data.mdb downloaded (with a progress bar) into the cache's LMDB folder (storage/cache.py),
    renamed into place when complete and reused while the remote one is unchanged. Copies
    are named by the URL, the endpoint and the object's size and version (ETag, generation
    or modification time): a dataset replaced under its URL is fetched again, and the copy
    of the old one removed. One larger than `cache_limit` is refused."""
    if storage.is_local(url):
        return storage.local_path(url)
    remote = storage.join(url, "data.mdb")
    size, version = storage.version(remote, storage_options)
    folder = cache.lmdb_copies(cache_dir, _digest(url, storage.endpoint(storage_options)))
    root = os.path.join(folder, _digest(str(size), version))
    if os.path.isfile(os.path.join(root, "data.mdb")):
        return root
    if not cache.whole_copy_fits(size, cache_limit):
        raise ShardkitError(
            f"{storage.display(remote)}: {size} bytes do not fit in cache_limit ({cache_limit} bytes), "
            "and an LMDB is read from a whole local copy: raise cache_limit"
        )
    _download(remote, storage_options, root, size, version)
    _remove_others(folder, keep=os.path.basename(root))
    return root


def _digest(*parts: str) -> str:
    """A file name for `parts` that shows none of them (URLs may hold credentials)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _download(remote: str, storage_options: StorageOptions | None, root: str, size: int, version: str) -> None:
    """`remote` into `root`/data.mdb, written under a temporary name and renamed into place."""
    import shutil

    from tqdm import tqdm

    tmp = f"{root}{storage.TMP_MARK}{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    try:
        with (
            storage.open_read(remote, storage_options) as src,
            open(os.path.join(tmp, "data.mdb"), "wb") as dst,
            tqdm(total=size, unit="B", unit_scale=True, desc=f"copying {storage.display(remote)}") as bar,
        ):
            got = 0  # counted here: bar.n stays 0 where tqdm is turned off (TQDM_DISABLE)
            while chunk := src.read(8 << 20):
                dst.write(chunk)
                got += len(chunk)
                bar.update(len(chunk))
            dst.flush()
            os.fsync(dst.fileno())  # a copy kept for later runs: whole on disk before it takes its name
        if got != size or storage.version(remote, storage_options) != (size, version):
            raise ShardkitError(
                f"{storage.display(remote)}: replaced while it was copied ({got} of {size} bytes "
                "came): run again to copy the new one"
            )
        os.rename(tmp, root)
    except BaseException:  # failed, or (OSError) another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(root, "data.mdb")):
            raise


def _remove_others(folder: str, keep: str) -> None:
    """Remove the copies of older versions in `folder` (a process still reading one keeps
    its open file); another process's download in progress is left alone."""
    import shutil

    for name in os.listdir(folder):
        if name != keep and storage.TMP_MARK not in name:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def shard_problem(
    url: str,
    info: ShardInfo,
    storage_options: StorageOptions | None = None,
    parse: bool = True,
    copy_to: Callable[[bytes], object] | None = None,
) -> str | None:
    """How the shard at `url` differs from `info`, its entry in the index (None: it does
    not): size, sha256, sample count, sample offsets. Reads it whole (handing its bytes to
    `copy_to`, if given); a shard that cannot be read or parsed raises (FileNotFoundError,
    CorruptShardError naming it, ...). With `parse=False`, a shard the index has a sha256
    for is only hashed: the same bytes as when it was indexed (a third faster than parsing
    them too)."""
    if not parse and info.sha256 is not None:
        size, sha256 = shard_digest(url, storage_options, copy_to)
        if size != info.bytes:
            return f"{size} bytes, index says {info.bytes}"
        return "sha256 mismatch (shard changed or corrupt)" if sha256 != info.sha256 else None
    found = scan_shard(url, storage_options, copy_to).info
    if found.bytes != info.bytes:
        return f"{found.bytes} bytes, index says {info.bytes}"
    if info.sha256 is not None and found.sha256 != info.sha256:
        return "sha256 mismatch (shard changed or corrupt)"
    if found.samples != info.samples:
        return f"{found.samples} samples, index says {info.samples}"
    if info.offsets is not None and found.offsets != info.offsets:
        return "sample offsets differ from the index"
    return None
