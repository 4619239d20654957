"""An LMDB's samples: each sample's key (and size) from the index, read from the
environment (a local copy of a remote LMDB) in windows, on threads once the disk is cold."""

from __future__ import annotations

from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ... import storage
from ...decode import sample_dict
from ...errors import CorruptShardError
from ...formats import lmdb as lmdb_format
from ...formats.gzip import MAX_MEMBER, inflate_fields
from ...index import Index
from ...index.resolve import local_lmdb
from ...storage import StorageOptions
from ..prefetch import Prefetcher
from .base import Read, Settings, gz_fields

LMDB_WINDOW = 64  # samples of an LMDB dataset that one read from the disk sends to the threads


class LmdbSamples:
    """An LMDB: each sample's key (and size, checked at each read), from the index; the
    environment is a local copy for a remote LMDB."""

    format = "lmdb"

    @classmethod
    def of(
        cls,
        idx: Index,
        urls: list[str],
        storage_options: StorageOptions | None,
        cache_dir: str | None,
        cache_limit: int,
        max_member: int = MAX_MEMBER,
    ) -> LmdbSamples:
        """The registry's constructor, the same for every source."""
        return cls(idx, urls, storage_options, cache_dir, cache_limit, max_member)

    def __init__(
        self,
        index: Index,
        urls: list[str],
        storage_options: StorageOptions | None,
        cache_dir: str | None,
        cache_limit: int,
        max_member: int = MAX_MEMBER,
    ):
        self.url, self.path = urls[0], local_lmdb(urls[0], storage_options, cache_dir, cache_limit)
        self.keys, self.sizes = lmdb_format.sample_tables(index.extra)
        self.max_member, self.gz = max_member, gz_fields(index)

    def reads(
        self,
        ids: np.ndarray,
        reader: storage.RangeReader,
        opts: Settings,
        window: int,
    ) -> tuple[Generator[Read, None, None], Prefetcher[Any, Any] | None]:
        return self._reads(ids, opts.read_ahead.depth(local=True)), None

    def _reads(self, ids: np.ndarray, threads: int) -> Generator[Read, None, None]:
        """(0, sample id, (key, fields) or the record's error) from the environment, opened in
        this process. In windows of `LMDB_WINDOW` samples: once a read in a window waited for
        the disk, the rest of that window on `threads` threads (formats/lmdb.read_when_cold)."""
        path, keys, sizes = self.path, self.keys, self.sizes
        env = lmdb_format.open_reader(path)

        def read(i: int) -> tuple[str, dict[str, bytes]] | CorruptShardError:
            key = keys[i].decode()
            try:
                return key, lmdb_format.read_one(env, key, path, None if sizes is None else int(sizes[i]))
            except CorruptShardError as e:  # a record missing or resized: skipped or raised, as bad data
                return e

        def touch(i: int) -> None:
            lmdb_format.touch_one(env, keys[i].decode())

        pool: ThreadPoolExecutor | None = None

        def pool_of_threads() -> ThreadPoolExecutor:
            nonlocal pool
            pool = pool or ThreadPoolExecutor(threads, thread_name_prefix="shardkit-lmdb")
            return pool

        when_cold = pool_of_threads if threads > 1 else None
        try:
            for k in range(0, len(ids), LMDB_WINDOW):
                window = ids[k : k + LMDB_WINDOW].tolist()
                for i, sample in zip(window, lmdb_format.read_when_cold(read, touch, window, when_cold)):
                    yield 0, i, sample
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def parse(self, data: tuple[str, dict[str, bytes]], url: str, start: int) -> tuple[dict[str, Any], int]:
        key, fields = data
        sample = sample_dict(key, url, fields)
        if self.gz:
            inflate_fields(sample, self.max_member)
        return sample, sum(map(len, fields.values()))

    def position(self, start: int) -> str:
        return ""

    def one(self, i: int, reader: storage.RangeReader) -> dict[str, Any]:
        _, _, data = next(self._reads(np.array([i]), 1))
        if isinstance(data, CorruptShardError):
            raise data
        return self.parse(data, self.url, i)[0]
