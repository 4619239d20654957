"""What a worker's pass needs, and nothing else: frozen, picklable values that a dataset
hands to the pass (pass_.py) in place of itself.

`SampleOrder` turns positions of an epoch's global sequence into sample ids (the shuffle
of partition.py); `ReadSpec` says how to read, check, decode and transform them. Neither
holds an open file or a client: they travel to DataLoader workers as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..order import blockplan, partition
from ..storage import RangeReader, StorageOptions
from ..storage.cache import RangeCache, range_cache

Transform = Callable[[dict[str, Any]], Any]
# The most reads in flight a worker keeps by default. Locally a read is the kernel's read-ahead
# of one block: a few suffice. From a store, the read-ahead's own measure (Little's law: the
# consumer's rate x a read's time) decides how many below this, and prefetch_bytes bounds the
# bytes: a cap of 8 held a 20 MB/s-a-connection link to a third of what it carries, and a
# 5%-at-1-s tail cost 42% of the rate (bench/remote at 10,000 images, 2026-12-02), where 32
# reads did not slow a store with nothing added.
LOCAL_DEPTH = 8
REMOTE_DEPTH = 32


@dataclass(frozen=True, eq=False)
class SampleOrder:
    """The samples of an epoch's sequence: a pure function of (seed, epoch, shard counts,
    blocks)."""

    counts: np.ndarray  # samples per shard
    seed: int
    shuffle: bool
    blocks: int | np.ndarray  # samples a block, or each block's bounds (compressed shards)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def epoch(self, epoch: int) -> blockplan.BlockOrder:
        """Epoch `epoch`'s global sequence."""
        return partition.epoch_order(self.counts, seed=self.seed, epoch=epoch, shuffle=self.shuffle, block=self.blocks)

    def ids_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The samples at `positions` of epoch `epoch`'s global sequence."""
        return self.epoch(epoch).ids(positions)

    def ids_in(self, epoch: int, positions: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        """`ids_at` for pieces of positions, one piece at a time (the epoch's order made once)."""
        order = self.epoch(epoch)
        for piece in positions:
            yield order.ids(piece)


@dataclass(frozen=True)
class ReadAhead:
    """How far a pass reads ahead of the samples it hands out, what the sample sources plan
    their reads by: `block` samples a block (the shuffle's unit, read as one range where its
    samples lie together), at most `prefetch` reads in flight (None: `LOCAL_DEPTH` from local
    disk, `REMOTE_DEPTH` from a store), at most `prefetch_bytes` held."""

    block: int = 64
    prefetch: int | None = None
    prefetch_bytes: int = 256 << 20

    def depth(self, local: bool) -> int:
        """The most reads in flight: `prefetch`, or the default for where the shards are."""
        if self.prefetch is not None:
            return self.prefetch
        return LOCAL_DEPTH if local else REMOTE_DEPTH


@dataclass(frozen=True, eq=False)
class ReadSpec:
    """How one dataset's samples are read, checked, decoded and transformed in a pass.
    `read_ahead` is what the sample sources read by; `versions` the shards' sha256s, `pins`
    their store versions."""

    urls: tuple[str, ...] = field(repr=False)  # a presigned URL carries its signature: never in a repr
    storage_options: StorageOptions | None = field(repr=False)  # nor credentials
    versions: tuple[str | None, ...]
    pins: tuple[dict[str, Any] | None, ...]
    order: SampleOrder
    decode: str = "raw"
    backend: str = "auto"
    transform: Transform | None = None
    on_error: str = "raise"
    verify: bool = False
    read_ahead: ReadAhead = ReadAhead()
    cache_dir: str | None = None
    cache_limit: int = 20 << 30
    # a slice of global batches (globalbatch.py): a block's other pieces are other ranks', so
    # samples are read as byte ranges, not whole blocks, and a skipped sample's place is taken
    # by the next usable sample by id, the same under any layout
    global_batches: bool = False

    def cache(self) -> RangeCache | None:
        return range_cache(self.cache_dir, self.cache_limit)

    def reader(self, cache: RangeCache | None, connections: int) -> RangeReader:
        """This pass's reader of the shards (made where it is used: it holds files and threads),
        keeping at most `connections` GETs open."""
        # the dataset read its index (or scanned its shards) there: the store was reachable
        return RangeReader(
            list(self.urls),
            self.storage_options,
            list(self.versions),
            cache,
            verify=self.verify,
            patient=True,
            pins=list(self.pins),
            connections=connections,
        )
