"""MapDataset: map-style random access to any dataset shardkit reads (tar shards, LMDB), for
DataLoader(shuffle=True), DistributedSampler and friends. TarDataset and LMDBDataset are its
named constructors (tar_dataset.py, lmdb_dataset.py): the same parameters, one format each.

What differs by format is the records' (map_records.py: how a sample is found and read);
what is shared is here: the index checks, decoding, the transform, a bad sample named in
one line, and the batch's reading threads. Those threads start only in DataLoader workers
(threads left in the process you train in would be there when it forks its workers), and
a pool inherited through fork has none: each process makes its own. The dataset pickles
for spawned workers: nothing open travels.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import torch.utils.data

from .. import checks
from ..decode import decoder
from ..errors import CorruptShardError, FieldError
from ..formats.gzip import MAX_MEMBER
from ..storage import StorageOptions
from . import worker
from .map_records import MapSettings, Opener, Records, open_any


class MapDataset(torch.utils.data.Dataset[Any]):
    """`ds[i]` is sample i as a WebDataset-style dict, decoded as `decode` says (as
    StreamingDataset does, `backend` too), or `transform(sample)`. `len(ds)` is the number of
    samples. The format is the index's (tar shards or an LMDB); TarDataset and LMDBDataset
    take the same parameters and refuse the other format.

    Args:
        source: a dataset folder or URL prefix (tar shards with index.json, or an LMDB), a
            brace pattern of shards, or a list of shard paths or URLs (shards without an
            index are scanned once).
        decode: how image fields come back: ``"raw"`` bytes, ``"pil"``, ``"rgb8"`` (HWC uint8
            numpy) or ``"tensor"`` (CHW uint8 torch).
        backend: ``"auto"`` (JPEG by the fast path, docs/decoding.md) or ``"pil"``.
        transform: a function of the sample dict; its result is what `ds[i]` returns (a
            top-level function under spawn).
        storage_options: passed to fsspec unchanged (``endpoint_url``, ``anon``, ...).
        cache_dir: a local folder for remote data: tar samples read once are kept there (None:
            no cache); a remote LMDB is copied there whole first (None: a temp folder).
        cache_limit: the size cap of the tar sample cache (least recently used entries go
            first), or the largest LMDB copied.
        read_threads: threads that read a DataLoader batch at once, in a worker: remote tar
            samples, or LMDB records once the disk is cold (1: one read at a time).
        max_member_size: the most a ``.gz`` field may inflate to.
        readahead: LMDB only: let the kernel read ahead around each record (helps sequential
            reads only). Ignored for tar shards, each sample already one read of its bytes,
            so that one call reads any format.
    """

    _opener: ClassVar[Opener | None] = None  # a named constructor's format; None: the index's
    _name: ClassVar[str] = "a MapDataset"  # how an index error names the dataset

    def __init__(
        self,
        source: str | Iterable[str],
        *,
        decode: str = "raw",
        backend: str = "auto",
        transform: Callable[[dict[str, Any]], Any] | None = None,
        storage_options: StorageOptions | None = None,
        cache_dir: str | None = None,
        cache_limit: int | str = "20GB",
        read_threads: int = 16,
        max_member_size: int | str = MAX_MEMBER,
        readahead: bool = False,
    ):
        decoder(decode, backend)  # validate now; each process builds its own (closures do not pickle)
        self.decode, self.backend, self.transform = decode, backend, checks.function("transform", transform)
        self.storage_options = checks.mapping("storage_options", storage_options)
        self.cache_dir, self.cache_limit = cache_dir, checks.size("cache_limit", cache_limit, 1)
        self.max_member_size = checks.size("max_member_size", max_member_size, 1)
        self.read_threads = checks.integer("read_threads", read_threads, 1)
        self.readahead = checks.flag("readahead", readahead)
        settings = MapSettings(self.storage_options, cache_dir, self.cache_limit, self.max_member_size, self.readahead)
        self.source = source
        opener = type(self)._opener
        self._records: Records = opener.open(source, settings) if opener is not None else open_any(source, settings)
        self.index, self.urls = self._records.index, self._records.urls
        self._threads: tuple[int, ThreadPoolExecutor] | None = None
        self._decode: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    def __len__(self) -> int:
        return len(self._records)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_threads": None, "_decode": None}

    def __getitem__(self, i: int) -> Any:
        return self._finish(self._read(i))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch's samples (DataLoader calls this when batching): read on `read_threads`
        threads in a DataLoader worker where they help, then each decoded and transformed in
        order on this thread. A subclass that overrides `__getitem__` gets its own method,
        sample by sample."""
        if type(self).__getitem__ is not MapDataset.__getitem__:
            return [self[i] for i in indices]
        records = self._records
        threads = self.read_threads > 1 and records.threads_help and torch.utils.data.get_worker_info() is not None
        reads = records.read_many([self._at(i) for i in indices], self._pool if threads else None)
        return [self._finish(sample) for sample in reads]

    def _pool(self) -> ThreadPoolExecutor:
        """This process's reading threads (a pool inherited through fork has none)."""
        if self._threads is None or self._threads[0] != os.getpid():
            prefix = f"shardkit-{self._records.KIND}"
            self._threads = (os.getpid(), ThreadPoolExecutor(self.read_threads, thread_name_prefix=prefix))
        return self._threads[1]

    def _at(self, i: int) -> int:
        """Sample `i` as a position in 0..len-1 (negative ones count from the end)."""
        i, n = checks.integer(f"{self._name} index", i, None), len(self._records)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples")
        return i % n

    def _read(self, i: int) -> dict[str, Any]:
        """Sample i, read and parsed, its `.gz` fields inflated."""
        return self._records.read(self._at(i))

    def _finish(self, sample: dict[str, Any]) -> Any:
        worker.settle()
        if self._decode is None:
            self._decode = decoder(self.decode, self.backend)
        try:
            sample = self._decode(sample)
            return self.transform(sample) if self.transform is not None else sample
        except FieldError as e:  # bad data, found by the decoder or a transform decoding (image_transform)
            raise CorruptShardError(self._records.bad(sample, e)) from e
