"""Counters in shared memory between a dataset and its DataLoader workers.

One writer per slot, no locks, and nothing ever waits on them, so they cannot hang or
collide: the epoch set by `set_epoch` in the main process (seen by workers, persistent or
not), the passes each worker made since (so an epoch is never silently repeated), and the
per-worker statistics behind `StreamingDataset.stats()`, and which loaded resume point is
in force (persistent workers hold the dataset they started with: the token tells them
whether their copy's resume point still applies). The order of an epoch never depends on
them beyond the epoch number.
"""

from __future__ import annotations

import ctypes
import multiprocessing
from collections.abc import Mapping
from multiprocessing.context import get_spawning_popen
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    from ..storage.cache import RangeCache
    from .prefetch import Prefetcher
    from ..storage import RangeReader

MAX_WORKERS = 128  # DataLoader workers per rank that the shared counters have room for
STATS = (
    "samples",
    "bytes",
    "read_s",
    "decode_s",
    "transform_s",
    "skipped",
    "fetched_bytes",
    "cache_hits",
    "throttled",
    "requests",
    "hedges",
    "hedge_wins",
    "prefetch_depth",
    "fetch_latency_s",
)
GAUGES = frozenset({"prefetch_depth", "fetch_latency_s"})  # last value per worker, not a running sum
COUNTS = frozenset(
    {"samples", "bytes", "skipped", "fetched_bytes", "cache_hits", "throttled", "requests", "hedges", "hedge_wins"}
)  # whole numbers
# pass counters: one per (layout, worker id), the layout being a DataLoader's num_workers or
# 0 for the main process (num_workers=0, a peek at one sample), so a pass of one layout never
# shifts another's epochs
_PASS_SLOTS = (MAX_WORKERS + 1) * (MAX_WORKERS + 2) // 2


def _pass_slot(worker_id: int, layout: int) -> int:
    return 1 + layout * (layout + 1) // 2 + worker_id


class Shared:
    """The shared arrays (see the module docstring)."""

    def __init__(self) -> None:
        # [set epoch, pass counters..., 1 + the layout `next_epoch` follows (0: none yet)]
        self.epoch = multiprocessing.RawArray("q", 2 + _PASS_SLOTS)
        self.stats = multiprocessing.RawArray("d", MAX_WORKERS * len(STATS))
        # [token of the resume point in force (0: none), the last token handed out, the token
        # of the last resume point a pass used up]
        self.resume = multiprocessing.RawArray("q", 3)

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory travels to processes this one starts (DataLoader workers); any other
        # pickle (a user's copy, a framework shipping the dataset) gets a private snapshot.
        if get_spawning_popen() is not None:
            return self.__dict__
        return {"values": (self.epoch[:], self.stats[:], self.resume[:])}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "values" not in state:
            self.__dict__.update(state)
            return
        Shared.__init__(self)
        self.epoch[:], self.stats[:], self.resume[:] = state["values"]

    def start_pass(self, worker_id: int, layout: int) -> tuple[int, int]:
        """(epoch, passes since set_epoch) for a new pass of this worker of this layout. A
        DataLoader worker's pass makes its layout the one `next_epoch` follows as it starts; a
        pass in the main process only once it ends (`ended_in_main`): a peek never does."""
        slot = _pass_slot(worker_id, layout)
        passes = self.epoch[slot]
        self.epoch[slot] = passes + 1
        if layout:
            self.epoch[-1] = 1 + layout
        return self.epoch[0] + passes, passes

    def ended_in_main(self) -> None:
        self.epoch[-1] = 1

    def resumed(self, worker_id: int, layout: int, epoch: int) -> None:
        """A worker restored mid-`epoch`: its next pass reads epoch + 1."""
        self.epoch[0] = epoch
        self.epoch[_pass_slot(worker_id, layout)] = 1
        self.epoch[-1] = 1 + layout

    def next_epoch(self) -> int:
        """The epoch the next pass of the layout followed reads: set_epoch's value plus the
        passes that layout ran since (other layouts' passes, a peek's, don't count)."""
        if not self.epoch[-1]:
            return int(self.epoch[0])
        layout = self.epoch[-1] - 1
        first = _pass_slot(0, layout)
        return int(self.epoch[0] + max(self.epoch[first : first + max(layout, 1)]))

    def new_resume(self) -> int:
        """Put a new resume point in force; its token (workers apply only the one in force)."""
        self.resume[1] += 1
        self.resume[0] = self.resume[1]
        return int(self.resume[0])

    def drop_resume(self) -> None:
        self.resume[0] = 0

    def use_up(self, token: int) -> None:
        """A pass resumed from the point `token` took it: set that epoch again for a whole one."""
        self.resume[2] = token

    def used_up(self, token: int) -> bool:
        return bool(token) and self.resume[2] == token

    def set_epoch(self, epoch: int) -> None:
        self.epoch[0] = epoch
        ctypes.memset(ctypes.addressof(self.epoch) + 8, 0, 8 * (_PASS_SLOTS + 1))

    def totals(self) -> dict[str, float]:
        """Counters summed over workers (the counts as ints); gauges averaged over the
        workers that set one."""
        arr = np.frombuffer(self.stats, dtype=np.float64).reshape(MAX_WORKERS, len(STATS))
        total: dict[str, float] = {
            name: int(v) if name in COUNTS else v for name, v in zip(STATS, arr.sum(axis=0).tolist())
        }
        active = arr[:, STATS.index("prefetch_depth")] > 0
        for name in GAUGES:
            column = arr[active, STATS.index(name)]
            total[name] = float(column.mean()) if len(column) else 0.0
        return total

    def add(self, worker_id: int, values: Mapping[str, float]) -> None:
        base = worker_id * len(STATS)
        for i, name in enumerate(STATS):
            if name in GAUGES:
                self.stats[base + i] = values[name]
            else:
                self.stats[base + i] += values[name]


class Slot(NamedTuple):
    """Where one worker's statistics go: its row of a dataset's shared counters."""

    shared: Shared
    worker_id: int


class Meter:
    """A worker's statistics, pushed to its slot of the shared counters every few hundred samples."""

    def __init__(self, slot: Slot, reader: RangeReader, cache: RangeCache | None):
        self.values = dict.fromkeys(STATS, 0.0)
        self._slot, self._reader, self._cache = slot, reader, cache
        self._fetched = self._hits = self._throttled = 0
        self._engine = dict.fromkeys(("requests", "hedges", "hedge_wins"), 0)  # the reader's fetch engine's, so far
        self.skips = 0  # this pass's, for the log's limit (values are reset at each flush)

    def sample(self, size: int, read_s: float, decode_s: float, transform_s: float) -> None:
        v = self.values
        v["samples"] += 1
        v["bytes"] += size
        v["read_s"] += read_s
        v["decode_s"] += decode_s
        v["transform_s"] += transform_s

    def skipped(self) -> None:
        self.values["skipped"] += 1
        self.skips += 1

    def flush(self, prefetcher: Prefetcher[Any, Any] | None) -> None:
        v = self.values
        v["fetched_bytes"], self._fetched = self._reader.fetched_bytes - self._fetched, self._reader.fetched_bytes
        v["throttled"], self._throttled = self._reader.throttled - self._throttled, self._reader.throttled
        for name, seen in self._engine.items():
            now = getattr(self._reader.engine, name)
            v[name], self._engine[name] = now - seen, now
        if self._cache is not None:
            v["cache_hits"], self._hits = self._cache.hits - self._hits, self._cache.hits
        if prefetcher is not None:
            v["prefetch_depth"], v["fetch_latency_s"] = prefetcher.target, prefetcher.latency_s
        self._slot.shared.add(self._slot.worker_id, v)
        self.values = dict.fromkeys(STATS, 0.0)
