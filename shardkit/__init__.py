"""shardkit: pack image folders into WebDataset-compatible shards and stream them to PyTorch.

`import shardkit` stays light: the packer and the index load without torch, and
StreamingDataset (which needs torch) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    CorruptShardError,
    DatasetNotFoundError,
    IndexVersionError,
    ShardkitError,
    SourceError,
    UnfinishedPackError,
)
from .index import Index, ShardInfo
from .packing.pack import pack
from .index.resolve import build_index
from .tools.verify import verify

if TYPE_CHECKING:
    from .reading.batching import collate
    from .reading.dataset import StreamingDataset
    from .reading.lmdb_dataset import LMDBDataset
    from .reading.map_dataset import MapDataset
    from .reading.tar_dataset import TarDataset

__all__ = [
    "CorruptShardError",
    "DatasetNotFoundError",
    "Index",
    "IndexVersionError",
    "LMDBDataset",
    "MapDataset",
    "ShardInfo",
    "ShardkitError",
    "SourceError",
    "StreamingDataset",
    "TarDataset",
    "UnfinishedPackError",
    "build_index",
    "collate",
    "pack",
    "verify",
]
__version__ = "0.1.0"

_LAZY = {
    "LMDBDataset": "reading.lmdb_dataset",
    "MapDataset": "reading.map_dataset",
    "StreamingDataset": "reading.dataset",
    "TarDataset": "reading.tar_dataset",
    "collate": "reading.batching",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        try:
            module = importlib.import_module(f".{_LAZY[name]}", __name__)
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] != "torch":
                raise
            raise ModuleNotFoundError(
                f"shardkit.{name} reads through PyTorch, which is not installed: pip install "
                "torch (the build you train with)",
                name="torch",
            ) from None
        return getattr(module, name)
    raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
