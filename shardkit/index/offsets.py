"""The sample offsets of an index of version 2: one binary file beside index.json.

`offsets-<digest>.npy` is a NumPy .npy file of little-endian int64: every shard's offset
table back to back, in the index's shard order. A shard of n samples has n + 1 entries
(each sample's first byte, then the end of its last one), so sample i of shard s is bytes
[table[f + s + i], table[f + s + i + 1]) where f is the number of samples in the shards
before s. 8 bytes a sample, never parsed: a reader maps the file into memory, and every
process of a machine reads it through the same page cache, touching only the pages of the
samples it reads. A remote dataset's file is copied once to a local cache first.

The name's digest covers each shard's name, sample count, size and sha256, which fix its
offsets: a rewritten index that describes other shards names another file, so an index
never points at a table that was not made for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import mmap
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from .. import storage
from ..errors import CorruptShardError, ShardkitError
from ..storage import StorageOptions, cache

PATTERN = re.compile(r"^offsets-[0-9a-f]{16}\.npy$")
DTYPE = np.dtype("<i8")
SMALL_FILE = 4 << 20  # an offsets file up to this size is fetched in one hedged read


def name_for(shards: Iterable[tuple[str, int, int, str | None]]) -> str:
    """The file name for the offsets of shards given as (name, samples, bytes, sha256)."""
    digest = hashlib.sha256(json.dumps(list(shards), separators=(",", ":")).encode()).hexdigest()
    return f"offsets-{digest[:16]}.npy"


def write(url: str, tables: Iterable[np.ndarray], entries: int, storage_options: StorageOptions | None = None) -> str:
    """Write the tables (one per shard, in order) as the .npy file `url`, atomically;
    returns its sha256. `tables` may be a generator: one table is held at a time."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": DTYPE.str, "fortran_order": False, "shape": (entries,)})
    sha, written = hashlib.sha256(header.getvalue()), 0
    with storage.atomic_writer(url, storage_options) as f:
        f.write(header.getvalue())
        for table in tables:
            data = np.ascontiguousarray(table, dtype=DTYPE).tobytes()
            written += len(data) // DTYPE.itemsize
            if written > entries:
                break
            sha.update(data)
            f.write(data)
        if written != entries:  # before the file takes its name: never a table of the wrong length
            raise ShardkitError(f"{storage.display(url)}: {written} offsets written, the index has {entries}")
    return sha.hexdigest()


class Offsets:
    """An offsets file mapped into memory, read-only (`array`). It maps itself at first use in
    each process and pickles as its path (never its contents)."""

    def __init__(self, path: str, entries: int, where: str):
        self.path, self.entries, self.where = path, entries, where
        self._array: np.ndarray | None = None

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = _map(self.path, self.entries, self.where)
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None}


def _map(path: str, entries: int, where: str) -> np.ndarray:
    """The file's table, mapped read-only with random access advised: a worker's samples
    touch a page of offsets here and there, and the kernel's read-around would otherwise pull
    in the pages about each one too (the whole file, in every process's memory count)."""
    try:
        with open(path, "rb") as f:
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(np.lib.format.read_magic(f))
            if read_header is None:
                raise ValueError("a .npy format version this shardkit does not read")
            shape, fortran, dtype = read_header(f)
            start = f.tell()
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if entries else None
    except FileNotFoundError:
        raise CorruptShardError(
            f"{where}: no such file, and index.json names it for its sample offsets (the dataset copied without it?)"
        ) from None
    except ValueError as e:
        raise CorruptShardError(f"{where}: not a table of sample offsets ({e})") from None
    if dtype != DTYPE or shape != (entries,) or fortran:
        raise CorruptShardError(
            f"{where}: holds {shape} {dtype} values; index.json expects {entries} int64 sample offsets"
        )
    if mapped is None:
        return np.empty(0, dtype=DTYPE)
    if len(mapped) < start + entries * DTYPE.itemsize:
        raise CorruptShardError(
            f"{where}: cut short ({len(mapped)} bytes, {entries} offsets need {start + entries * DTYPE.itemsize})"
        )
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=DTYPE, count=entries, offset=start)


def open_table(
    folder: str,
    name: str,
    sha256: str,
    entries: int,
    storage_options: StorageOptions | None = None,
    cache_dir: str | None = None,
) -> Offsets:
    """The offsets file `name` of the dataset at `folder`, checked for its length (local) or
    copied to `cache_dir` and checked for its sha256 (remote)."""
    url = storage.join(folder, name)
    if storage.is_local(url):
        path = storage.local_path(url)
    else:
        path = _fetch(url, sha256, storage_options, cache_dir, small=entries * DTYPE.itemsize <= SMALL_FILE)
    table = Offsets(path, entries, storage.display(url))
    table.array  # noqa: B018 - fail here, in the main process, not in a worker
    return table


def _fetch(url: str, sha256: str, storage_options: StorageOptions | None, cache_dir: str | None, small: bool) -> str:
    """A local copy of the remote offsets file `url`: one download per machine, the processes of
    a machine waiting on a file lock for the first one's. Its name never changes its bytes,
    so a copy found is a copy to use. A `small` one is one hedged read (storage.read_hedged:
    it is on the way to an epoch's first batch), a large one streamed to disk."""
    import fcntl

    folder = cache.folder(cache.OFFSETS, cache_dir)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{sha256[:24]}.npy")
    with open(os.path.join(folder, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):
            return path
        tmp = f"{path}{storage.TMP_MARK}{os.getpid()}"
        sha = hashlib.sha256()
        try:
            with open(tmp, "wb") as dst:
                for chunk in _chunks(url, storage_options, small):
                    sha.update(chunk)
                    dst.write(chunk)
            if sha.hexdigest() != sha256:
                raise CorruptShardError(
                    f"{storage.display(url)}: sha256 mismatch with index.json (replaced or corrupt)"
                )
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    return path


def _chunks(url: str, storage_options: StorageOptions | None, small: bool) -> Iterator[bytes]:
    if small:
        yield storage.read_hedged(url, storage_options)
        return
    with storage.open_read(url, storage_options) as src:
        while chunk := src.read(8 << 20):
            yield chunk


def tables(offsets: np.ndarray, samples: Sequence[int]) -> list[np.ndarray]:
    """Each shard's own table, out of the tables back to back."""
    first = np.cumsum(samples) - samples + np.arange(len(samples))
    return [np.asarray(offsets[int(f) : int(f) + n + 1]) for f, n in zip(first, samples)]
