"""LMDBDataset: map-style random access to an LMDB dataset, for DataLoader(shuffle=True),
DistributedSampler and friends.

The environment is opened lazily in each process that reads (one inherited through fork is
closed, never used: a shared LMDB handle corrupts reads), read-only, without locks and
without OS readahead, which only wastes I/O on random access of small records.

Cold page cache: py-lmdb faults in every page of a value (one byte a page, with the GIL
released), and without readahead each page is its own 4 KB disk read, one after another:
~3 ms for a 100 KB image here, 2x slower than opening the file. So a DataLoader batch
(`__getitems__`) in a DataLoader worker has `read_threads` threads fault its records in
at once, the disk seeing that many requests in flight instead of one (the threads copy
nothing: formats/lmdb.touch_one); only once a read waited for the disk, though: with the
records cached, handing each to a thread cost 3-5x the read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.utils.data

from .. import checks
from . import worker
from ..decode import decoder, packed_from, sample_dict
from ..errors import FIND_BAD, CorruptShardError, FieldError, describe
from ..formats import lmdb as lmdb_format
from ..sources import lmdb_index, local_lmdb
from ..storage import StorageOptions


class LMDBDataset(torch.utils.data.Dataset[Any]):
    """`ds[i]` is sample i as a WebDataset-style dict (decoded as `decode` says, like
    StreamingDataset, `backend` too), or `transform(sample)`. A remote URL is first copied to `cache_dir`
    (refused if larger than `cache_limit`).

    Args:
        source: the LMDB dataset's folder (or a URL, copied locally first).
        decode: ``"raw"``, ``"pil"``, ``"rgb8"`` or ``"tensor"``, as StreamingDataset's.
        backend: ``"auto"`` (JPEG by the fast path, docs/decoding.md) or ``"pil"``, as StreamingDataset's.
        transform: a function of the sample dict; `ds[i]` returns its result.
        storage_options: passed to fsspec unchanged, for a remote source.
        cache_dir: where a remote LMDB is copied.
        cache_limit: the largest LMDB copied into `cache_dir`.
        readahead: let the kernel read ahead around each record (helps sequential reads only).
        read_threads: threads that read a batch's records at once when the disk is cold.
    """

    def __init__(self, source: str, *, decode: str = "raw", backend: str = "auto", transform: Callable[[dict[str, Any]], Any] | None = None,
                 storage_options: StorageOptions | None = None, cache_dir: str | None = None,
                 cache_limit: int | str = "20GB", readahead: bool = False, read_threads: int = 16):
        source = checks.path("source", source)
        decoder(decode, backend)  # validate now; each process builds its own (closures do not pickle)
        self.decode, self.backend, self.source = decode, backend, source
        self.transform = checks.function("transform", transform)
        self.readahead, self.read_threads = checks.flag("readahead", readahead), checks.integer("read_threads", read_threads, 1)
        self._threads: tuple[int, ThreadPoolExecutor] | None = None
        storage_options = checks.mapping("storage_options", storage_options)
        self.path = local_lmdb(source, storage_options, cache_dir, checks.size("cache_limit", cache_limit))
        idx = lmdb_index(self.path, self.readahead)
        if idx.kind != "lmdb":
            raise ValueError(f"{source}: not an LMDB dataset (kind {idx.kind!r})")
        self._keys, self._sizes = lmdb_format.sample_tables(idx.extra)
        self.index = idx.slim()
        self._decode: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    def __len__(self) -> int:
        return len(self._keys)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_decode"] = state["_threads"] = None
        return state

    def __getitem__(self, i: int) -> Any:
        return self._finish(*self._read(i))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch's samples (DataLoader calls this when batching), decoded and transformed
        in order on this thread as their records arrive (see `_records`). A subclass that
        overrides `__getitem__` gets its own method, sample by sample."""
        if type(self).__getitem__ is not LMDBDataset.__getitem__:
            return [self[i] for i in indices]
        return [self._finish(key, fields) for key, fields in self._records(indices)]

    def _records(self, indices: list[int]) -> Iterator[tuple[str, dict[str, bytes]]]:
        """The records, on `read_threads` threads once one read waited for the disk (see
        formats/lmdb.read_when_cold). Threads only in DataLoader workers: threads left in the
        process you train in would be there when it forks its workers."""
        threads = self.read_threads > 1 and torch.utils.data.get_worker_info() is not None
        return lmdb_format.read_when_cold(self._read, self._touch, indices, self._pool if threads else None)

    def _pool(self) -> ThreadPoolExecutor:
        """This process's reading threads (a pool inherited through fork has none)."""
        if self._threads is None or self._threads[0] != os.getpid():
            self._threads = (os.getpid(), ThreadPoolExecutor(self.read_threads, thread_name_prefix="shardkit-lmdb"))
        return self._threads[1]

    def _read(self, i: int) -> tuple[str, dict[str, bytes]]:
        i = checks.integer("an LMDBDataset index", i, None)
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} samples")
        key = self._keys[i].decode()
        size = int(self._sizes[i]) if self._sizes is not None else None
        return key, lmdb_format.read_one(lmdb_format.open_reader(self.path, self.readahead), key, self.path, size)

    def _touch(self, i: int) -> None:
        lmdb_format.touch_one(lmdb_format.open_reader(self.path, self.readahead), self._keys[i].decode())

    def _finish(self, key: str, fields: dict[str, bytes]) -> Any:
        worker.settle()
        if self._decode is None:
            self._decode = decoder(self.decode, self.backend)
        sample = sample_dict(key, self.source, fields)
        try:
            sample = self._decode(sample)
            return self.transform(sample) if self.transform is not None else sample
        except FieldError as e:  # bad data, found by the decoder or a transform decoding (image_transform)
            raise CorruptShardError(f"{self.path}: sample {key}{packed_from(sample)}: {describe(e)}; {FIND_BAD}") from e
