"""The records a map-style dataset reads, one kind per format (the index's `kind`): each
knows how to open a source, read sample i as a raw WebDataset-style dict (`.gz` fields
inflated), read a batch, and name a bad sample. Decoding, transforms, index checks and the
threads are MapDataset's (map_dataset.py), shared by every format.

Which records read a dataset is looked up in one place, `RECORDS` (by the index's kind);
nothing else here or in map_dataset.py asks a format's name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from .. import checks, storage
from ..decode import packed_from, sample_dict
from ..errors import FIND_BAD, FieldError, ShardkitError, describe
from ..formats import lmdb as lmdb_format
from ..formats.gzip import inflate_fields
from ..index import Index
from ..index.resolve import lmdb_index, local_lmdb, resolve
from ..storage import StorageOptions
from ..storage.cache import range_cache
from .sources.base import gz_fields
from .sources.tar import TarSamples

Pool = Callable[[], Executor]  # this process's reading threads, made on first use


@dataclass(frozen=True)
class MapSettings:
    """What opening and reading records needs, checked already (see MapDataset)."""

    storage_options: StorageOptions
    cache_dir: str | None
    cache_limit: int
    max_member_size: int
    readahead: bool


class Records(Protocol):
    KIND: ClassVar[str]  # the index's kind these records read
    DATASET: ClassVar[str]  # the named constructor that reads them, for messages
    index: Index  # slim: no per-sample tables (those live in the records' arrays)
    urls: list[str]  # what is read: the shards, or the local LMDB folder
    threads_help: bool  # whether a batch gains from reading threads

    def __len__(self) -> int: ...

    def read(self, i: int) -> dict[str, Any]: ...

    def read_many(self, indices: Sequence[int], pool: Pool | None) -> Iterator[dict[str, Any]]: ...

    def bad(self, sample: dict[str, Any], error: FieldError) -> str: ...


class TarRecords:
    """Tar shards: sample i is one read of its byte range, known from the index (index.json,
    or a scan of shards without one): `pread` on a local shard, a ranged GET on a remote
    one, retried, through the disk cache when `cache_dir` is given. A batch's remote
    samples are fetched on threads (a remote read is mostly waiting)."""

    KIND: ClassVar[str] = "tar"
    DATASET: ClassVar[str] = "TarDataset"

    def __init__(self, urls: list[str], idx: Index, s: MapSettings):
        for url, shard in zip(urls, idx.shards):
            if shard.compression:
                raise ShardkitError(
                    f"{storage.display(url)}: {shard.compression}-compressed: a stream, no sample can "
                    "be read without inflating all before it; `shardkit pack` it into plain tar "
                    "shards for random access, or read it with StreamingDataset"
                )
        self.urls, self._settings, self._len = urls, s, idx.samples
        self._samples = TarSamples(idx, urls, s.storage_options, s.cache_dir, s.max_member_size)
        self._versions, self._pins = [sh.sha256 for sh in idx.shards], [sh.version for sh in idx.shards]
        self.index = idx.slim()  # the offsets live on in the sample source's arrays only
        self.threads_help = not all(map(storage.is_local, urls))
        self._open: tuple[int, storage.RangeReader] | None = None

    @classmethod
    def open(cls, source: str | Iterable[str], s: MapSettings) -> Records:
        """The records of `source`, refused in one line if the index says another format."""
        urls, idx = resolve(source, s.storage_options)
        if idx.kind != cls.KIND:
            raise ValueError(f"{source}: an {idx.kind.upper()} dataset: read it with {records_for(idx.kind).DATASET}")
        return cls(urls, idx, s)

    @classmethod
    def resolved(cls, source: str | Iterable[str], urls: list[str], idx: Index, s: MapSettings) -> Records:
        return cls(urls, idx, s)

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": None}

    def _reader(self) -> storage.RangeReader:
        """This process's reader (one inherited through fork is another process's: never used)."""
        if self._open is None or self._open[0] != os.getpid():
            s = self._settings
            cache = range_cache(s.cache_dir, s.cache_limit)
            # the index was read (or the shards scanned) there: the store was reachable
            reader = storage.RangeReader(
                self.urls, s.storage_options, self._versions, cache, patient=True, pins=self._pins
            )
            self._open = (os.getpid(), reader)
        return self._open[1]

    def read(self, i: int) -> dict[str, Any]:
        return self._samples.one(i, self._reader())

    def read_many(self, indices: Sequence[int], pool: Pool | None) -> Iterator[dict[str, Any]]:
        return pool().map(self.read, indices) if pool is not None and len(indices) > 1 else map(self.read, indices)

    def bad(self, sample: dict[str, Any], error: FieldError) -> str:
        return f"{storage.display(sample['__url__'])}: sample {sample['__key__']}: {describe(error)}"


class LmdbRecords:
    """One LMDB (a remote one copied to `cache_dir` first, refused if larger than
    `cache_limit`), its index read from inside it. The environment is opened lazily in each
    process that reads (formats/lmdb.open_reader), without OS readahead unless asked. A
    batch on a cold page cache has threads fault its records in at once (the threads copy
    nothing: formats/lmdb.read_when_cold); with the records cached, no thread."""

    KIND: ClassVar[str] = "lmdb"
    DATASET: ClassVar[str] = "LMDBDataset"
    threads_help = True

    def __init__(self, source: str, s: MapSettings):
        self.source, self.readahead, self.max_member = source, s.readahead, s.max_member_size
        self.path = local_lmdb(source, s.storage_options, s.cache_dir, s.cache_limit)
        idx = lmdb_index(self.path, s.readahead)
        if idx.kind != self.KIND:
            raise ValueError(f"{source}: not an LMDB dataset (kind {idx.kind!r})")
        self.urls = [self.path]
        self._keys, self._sizes = lmdb_format.sample_tables(idx.extra)
        self.gz = gz_fields(idx)
        self.index = idx.slim()

    @classmethod
    def open(cls, source: str | Iterable[str], s: MapSettings) -> Records:
        return cls(checks.path("source", source), s)

    @classmethod
    def resolved(cls, source: str | Iterable[str], urls: list[str], idx: Index, s: MapSettings) -> Records:
        return cls(urls[0], s)  # the index inside the LMDB is the one read

    def __len__(self) -> int:
        return len(self._keys)

    def read(self, i: int) -> dict[str, Any]:
        key = self._keys[i].decode()
        size = int(self._sizes[i]) if self._sizes is not None else None
        fields = lmdb_format.read_one(lmdb_format.open_reader(self.path, self.readahead), key, self.path, size)
        sample = sample_dict(key, self.source, fields)
        if self.gz:
            inflate_fields(sample, self.max_member)
        return sample

    def _touch(self, i: int) -> None:
        lmdb_format.touch_one(lmdb_format.open_reader(self.path, self.readahead), self._keys[i].decode())

    def read_many(self, indices: Sequence[int], pool: Pool | None) -> Iterator[dict[str, Any]]:
        return lmdb_format.read_when_cold(self.read, self._touch, indices, pool)

    def bad(self, sample: dict[str, Any], error: FieldError) -> str:
        return f"{self.path}: sample {sample['__key__']}{packed_from(sample)}: {describe(error)}; {FIND_BAD}"


class Opener(Protocol):
    """A records class, as a value: what opens records (a class's own attributes and classmethods)."""

    @property
    def DATASET(self) -> str: ...  # noqa: N802 (the class attribute it stands for)

    def open(self, source: str | Iterable[str], s: MapSettings) -> Records: ...

    def resolved(self, source: str | Iterable[str], urls: list[str], idx: Index, s: MapSettings) -> Records: ...


RECORDS: dict[str, Opener] = {TarRecords.KIND: TarRecords, LmdbRecords.KIND: LmdbRecords}


def records_for(kind: str) -> Opener:
    """The records of the format `kind` (the one place a map-style dataset looks a format up)."""
    if kind not in RECORDS:
        raise ShardkitError(f"a {kind!r} dataset has no map-style reader: read it with StreamingDataset")
    return RECORDS[kind]


def open_any(source: str | Iterable[str], s: MapSettings) -> Records:
    """The records of whichever format `source`'s index says."""
    urls, idx = resolve(source, s.storage_options)
    return records_for(idx.kind).resolved(source, urls, idx, s)
