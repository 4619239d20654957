"""TarDataset: MapDataset over tar shards, the ones a WebDataset user already has.

gzip-compressed shards are streams with no random access: refused, with the way out
(`shardkit pack` converts them to plain shards; StreamingDataset reads them as they are).
"""

from __future__ import annotations

from typing import ClassVar

from .map_dataset import MapDataset
from .map_records import Opener, TarRecords


class TarDataset(MapDataset):
    """MapDataset (same parameters) over tar shards: `ds[i]` is one read of sample i's byte
    range, known from the index (index.json, or a scan of shards without one): `pread` on a
    local shard, a ranged GET on a remote one (S3, GCS, HTTP...), retried, through the disk
    cache when `cache_dir` is given; a DataLoader batch's remote samples are fetched
    `read_threads` at a time in a worker (a remote read is mostly waiting). `readahead` is
    ignored. An LMDB dataset is refused, naming LMDBDataset."""

    _opener: ClassVar[Opener | None] = TarRecords
    _name: ClassVar[str] = "a TarDataset"
