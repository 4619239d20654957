"""The dataset's index: index.json, what a reader needs before it touches a shard.

model.py is the document (shards, versions, to and from JSON, checks), offsets.py the binary
offsets file of a tar dataset's sample offsets, io.py reading and writing them in a folder,
resolve.py what a user points at turned into shard URLs and an Index."""

from ..formats.lmdb import DATA_FILE as LMDB_DATA_FILE
from .io import check_finished, find, load, pinned, sample_offsets, save, with_offsets, with_offsets_file, with_pins
from .model import (
    FORMAT,
    INDEX_NAME,
    PROGRESS_DIR,
    READS,
    SHARD_SUFFIXES,
    VERSION,
    Index,
    ShardInfo,
    OffsetsFile,
    Skipped,
)

__all__ = [
    "FORMAT",
    "INDEX_NAME",
    "LMDB_DATA_FILE",
    "PROGRESS_DIR",
    "READS",
    "SHARD_SUFFIXES",
    "VERSION",
    "Index",
    "ShardInfo",
    "OffsetsFile",
    "Skipped",
    "check_finished",
    "find",
    "load",
    "pinned",
    "sample_offsets",
    "save",
    "with_offsets",
    "with_offsets_file",
    "with_pins",
]
