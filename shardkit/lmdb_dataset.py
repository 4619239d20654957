"""LMDBDataset: map-style random access to an LMDB dataset, for DataLoader(shuffle=True),
DistributedSampler and friends.

The environment is opened lazily in each process that reads (one inherited through fork is
closed, never used: a shared LMDB handle corrupts reads), read-only, without locks and
without OS readahead, which only wastes I/O on random access of small records.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch.utils.data

from . import worker
from .decode import decoder
from .formats import lmdb as lmdb_format
from .sources import lmdb_index, local_lmdb
from .storage import StorageOptions


class LMDBDataset(torch.utils.data.Dataset):
    """`ds[i]` is sample i as a WebDataset-style dict (decoded as `decode` says, like
    StreamingDataset), or `transform(sample)`. A remote URL is first copied to `cache_dir`."""

    def __init__(self, source: str, *, decode: str = "raw", transform: Callable[[dict[str, Any]], Any] | None = None,
                 storage_options: StorageOptions | None = None, cache_dir: str | None = None,
                 readahead: bool = False):
        decoder(decode)  # validate now; each process builds its own (closures do not pickle)
        self.decode, self.transform, self.source, self.readahead = decode, transform, source, readahead
        self.path = local_lmdb(source, storage_options, cache_dir)
        idx = lmdb_index(self.path)
        if idx.kind != "lmdb":
            raise ValueError(f"{source}: not an LMDB dataset (kind {idx.kind!r})")
        self.index = idx
        self._keys = np.array(idx.extra.get("keys", []), dtype="S")  # numpy: no per-key objects to copy on fork
        self._decode: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    def __len__(self) -> int:
        return len(self._keys)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_decode"] = None
        return state

    def __getitem__(self, i: int) -> Any:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} samples")
        key = self._keys[i].decode()
        with lmdb_format.open_reader(self.path, self.readahead).begin(buffers=True) as txn:
            fields = lmdb_format.read_sample(txn, key, self.path)
        if self._decode is None:  # first sample in this process
            worker.settle()
            self._decode = decoder(self.decode)
        sample = self._decode({"__key__": key, "__url__": self.source, **fields})
        return self.transform(sample) if self.transform is not None else sample
