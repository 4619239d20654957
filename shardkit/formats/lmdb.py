"""LMDB datasets: one record per tar-style member, key `KEY.EXT`, value the raw bytes, plus
the dataset's index document under `__index__`. A reader needs nothing but `lmdb`:

    env = lmdb.open("photos.lmdb", readonly=True, lock=False)
    with env.begin() as txn:
        index = json.loads(txn.get(b"__index__"))
        key = index["keys"][0]
        image, label = txn.get(f"{key}.jpg".encode()), int(txn.get(f"{key}.cls".encode()))

Keys are zero-padded sample numbers, so a sample's members are adjacent in LMDB's sorted
key order and one cursor walk collects them. Writing happens in transactions, each also
recording how far the pack got (`__progress__`), so a killed pack leaves a database that is
consistent, resumable, and never taken for finished: `__index__` is written last.

The records and their reading are lmdb_records.py's, this process's environments
lmdb_envs.py's, writing lmdb_writer.py's and the reads of a window lmdb_cold_reads.py's;
here is what the rest of shardkit asks of an LMDB, by these names.
"""

from __future__ import annotations

from .lmdb_cold_reads import read_when_cold, touch_one
from .lmdb_envs import close_reader, open_reader
from .lmdb_records import (
    DATA_FILE,
    INDEX_KEY,
    LOCK_FILE,
    MAX_KEY,
    PROGRESS_KEY,
    check_keys,
    is_lmdb,
    read_index,
    read_one,
    read_sample,
    sample_tables,
)
from .lmdb_writer import Writer

__all__ = [
    "DATA_FILE",
    "INDEX_KEY",
    "LOCK_FILE",
    "MAX_KEY",
    "PROGRESS_KEY",
    "Writer",
    "check_keys",
    "close_reader",
    "is_lmdb",
    "open_reader",
    "read_index",
    "read_one",
    "read_sample",
    "read_when_cold",
    "sample_tables",
    "touch_one",
]
