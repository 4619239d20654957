"""LMDBDataset: MapDataset over one LMDB.

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

from typing import ClassVar

from .map_dataset import MapDataset
from .map_records import LmdbRecords, Opener


class LMDBDataset(MapDataset):
    """MapDataset (same parameters) over an LMDB dataset's folder: a remote URL is first
    copied whole to `cache_dir` (refused if larger than `cache_limit`), and the index is
    the one stored inside the LMDB. `readahead=True` lets the kernel read ahead around each
    record (helps sequential reads only). Tar shards are refused in one line."""

    _opener: ClassVar[Opener | None] = LmdbRecords
    _name: ClassVar[str] = "an LMDBDataset"

    @property
    def path(self) -> str:
        """The local folder read: the source itself, or a remote LMDB's copy."""
        return self.urls[0]
