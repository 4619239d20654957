"""TarDataset: map-style access to tar shards, sample by sample, for DataLoader(shuffle=True),
DistributedSampler and friends, over the shards a WebDataset user already has.

Sample i is one read of its byte range, known from the index (index.json, or a scan of
shards without one, as StreamingDataset makes): `pread` on a local shard, straight into the
sample's bytes; a ranged GET on a remote one (S3, GCS, HTTP...), retried, through the disk
cache when `cache_dir` is given. Reading is opened lazily in each process that reads, so
the dataset pickles for spawned workers. In a DataLoader worker, a batch's remote samples
are fetched `read_threads` at a time (a remote read is mostly waiting).

gzip-compressed shards are streams with no random access: refused, with the way out
(`shardkit pack` converts them to plain shards; StreamingDataset reads them as they are).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.utils.data

from .. import checks, storage
from ..decode import decoder
from ..errors import CorruptShardError, FieldError, ShardkitError, describe
from ..formats.gzip import MAX_MEMBER
from ..sources import resolve
from ..storage import StorageOptions
from ..storage.cache import RangeCache
from . import worker
from .samples import TarSamples


class TarDataset(torch.utils.data.Dataset[Any]):
    """`ds[i]` is sample i of tar shards as a WebDataset-style dict, decoded as `decode` says
    (as StreamingDataset does), or `transform(sample)`. `len(ds)` is the number of samples.

    Args:
        source: a dataset folder or URL prefix holding index.json, a brace pattern of shards,
            or a list of shard paths or URLs (shards without an index are scanned once).
        decode: how image fields come back: ``"raw"`` bytes, ``"pil"``, ``"rgb8"`` (HWC uint8
            numpy) or ``"tensor"`` (CHW uint8 torch).
        transform: a function of the sample dict; its result is what `ds[i]` returns (a
            top-level function under spawn).
        storage_options: passed to fsspec unchanged (``endpoint_url``, ``anon``, ...).
        cache_dir: a local folder that keeps the remote samples read once (None: no cache).
        cache_limit: the cache's size cap; least recently used entries go first.
        max_member_size: the most a ``.gz`` field may inflate to.
        read_threads: remote samples of a DataLoader batch fetched at once, in a worker.
    """

    def __init__(self, source: str | Iterable[str], *, decode: str = "raw",
                 transform: Callable[[dict[str, Any]], Any] | None = None, storage_options: StorageOptions | None = None,
                 cache_dir: str | None = None, cache_limit: int | str = "20GB", max_member_size: int | str = MAX_MEMBER,
                 read_threads: int = 16):
        decoder(decode)  # validate now; each process builds its own (closures do not pickle)
        self.decode, self.transform = decode, checks.function("transform", transform)
        self.storage_options = checks.mapping("storage_options", storage_options)
        self.cache_dir, self.cache_limit = cache_dir, checks.size("cache_limit", cache_limit, 1)
        self.max_member_size = checks.size("max_member_size", max_member_size, 1)
        self.read_threads = checks.integer("read_threads", read_threads, 1)
        self.urls, idx = resolve(source, self.storage_options)
        if idx.kind != "tar":
            raise ValueError(f"{source}: an {idx.kind.upper()} dataset: read it with LMDBDataset")
        for url, shard in zip(self.urls, idx.shards):
            if shard.compression:
                raise ShardkitError(f"{storage.display(url)}: {shard.compression}-compressed: a stream, no sample can "
                                    "be read without inflating all before it; `shardkit pack` it into plain tar "
                                    "shards for random access, or read it with StreamingDataset")
        self._samples = TarSamples(idx, self.urls, self.storage_options, self.cache_dir, self.max_member_size)
        self._len = idx.samples
        self._versions, self._pins = [s.sha256 for s in idx.shards], [s.version for s in idx.shards]
        self.index = idx.slim()  # the offsets live on in the sample source's arrays only
        self._remote = not all(map(storage.is_local, self.urls))
        self._open: tuple[int, storage.RangeReader, ThreadPoolExecutor | None] | None = None
        self._decode: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = state["_decode"] = None
        return state

    def __getitem__(self, i: int) -> Any:
        return self._finish(self._read(i))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch's samples (DataLoader calls this when batching): remote ones fetched on
        `read_threads` threads in a DataLoader worker, then each decoded and transformed in
        order. A subclass that overrides `__getitem__` gets its own method, sample by sample."""
        if type(self).__getitem__ is not TarDataset.__getitem__:
            return [self[i] for i in indices]
        pool = self._reader()[1]
        reads = pool.map(self._read, indices) if pool is not None and len(indices) > 1 else map(self._read, indices)
        return [self._finish(sample) for sample in reads]

    def _reader(self) -> tuple[storage.RangeReader, ThreadPoolExecutor | None]:
        """This process's reader, and its threads where they help (a reader or pool
        inherited through fork is another process's: never used)."""
        if self._open is None or self._open[0] != os.getpid():
            cache = RangeCache(self.cache_dir, self.cache_limit) if self.cache_dir is not None else None
            # the index was read (or the shards scanned) there: the store was reachable
            reader = storage.RangeReader(self.urls, self.storage_options, self._versions, cache, patient=True,
                                         pins=self._pins)
            threads = self._remote and self.read_threads > 1 and torch.utils.data.get_worker_info() is not None
            pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="shardkit-tar") if threads else None
            self._open = (os.getpid(), reader, pool)
        return self._open[1], self._open[2]

    def _read(self, i: int) -> dict[str, Any]:
        """Sample i, read and parsed, its `.gz` fields inflated."""
        i = checks.integer("a TarDataset index", i, None)
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} out of range for {self._len} samples")
        return self._samples.one(i % self._len, self._reader()[0])

    def _finish(self, sample: dict[str, Any]) -> Any:
        worker.settle()
        if self._decode is None:
            self._decode = decoder(self.decode)
        try:
            sample = self._decode(sample)
            return self.transform(sample) if self.transform is not None else sample
        except FieldError as e:  # bad data, found by the decoder or a transform decoding (image_transform)
            raise CorruptShardError(f"{storage.display(sample['__url__'])}: sample {sample['__key__']}: "
                                    f"{describe(e)}") from e
