"""StreamingDataset: a torch IterableDataset over shards, split across DDP ranks and
DataLoader workers, every rank yielding exactly the same number of samples.

The dataset object is cheap to build and to pickle: it holds the index as numpy arrays.
Everything else (open files, the worker's plan) is made inside `__iter__`, in the worker.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch.utils.data
from multiprocessing.context import get_spawning_popen

from . import partition, ranges, storage
from .decode import decoder
from .errors import CorruptShardError, ShardkitError
from .formats.tar import parse_sample
from .index import Index
from .cache import RangeCache
from .partition import Layout, Progress
from .prefetch import Prefetcher
from .formats import lmdb as lmdb_format
from .sources import local_lmdb, resolve
from .storage import StorageOptions
from .units import parse_size

STATE_MARK = "shardkit"  # identifies our state inside a StatefulDataLoader state dict
MAX_WORKERS = 128  # DataLoader workers per rank that the shared counters have room for
_STATS = ("samples", "bytes", "read_s", "decode_s", "transform_s", "skipped", "fetched_bytes", "cache_hits",
          "prefetch_depth", "fetch_latency_s")
_GAUGES = frozenset({"prefetch_depth", "fetch_latency_s"})  # last value per worker, not a running sum
# pass counters: one per (num_workers, worker id), so a pass with another layout (a peek in
# the main process, a loader with other num_workers) never shifts this layout's epochs
_PASS_SLOTS = MAX_WORKERS * (MAX_WORKERS + 1) // 2


def _pass_slot(worker_id: int, num_workers: int) -> int:
    return 1 + num_workers * (num_workers - 1) // 2 + worker_id


class _Shared:
    """Counters in shared memory, one writer per slot, no locks, nothing waits on them.

    - the epoch set by `set_epoch` in the main process, seen by workers (persistent or not);
    - passes per worker since then, so an epoch is never silently repeated;
    - per-worker statistics for `stats()`.
    """

    def __init__(self) -> None:
        self.epoch = multiprocessing.RawArray("q", 1 + _PASS_SLOTS)
        self.stats = multiprocessing.RawArray("d", MAX_WORKERS * len(_STATS))

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory travels to processes this one starts (DataLoader workers); any other
        # pickle (a user's copy, a framework shipping the dataset) gets a private snapshot.
        if get_spawning_popen() is not None:
            return self.__dict__
        return {"values": (self.epoch[:], self.stats[:])}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "values" not in state:
            self.__dict__.update(state)
            return
        self.__init__()  # type: ignore[misc]
        self.epoch[:], self.stats[:] = state["values"]

    def start_pass(self, worker_id: int, num_workers: int) -> tuple[int, int]:
        """(epoch, passes since set_epoch) for a new pass of this worker of this layout."""
        slot = _pass_slot(worker_id, num_workers)
        passes = self.epoch[slot]
        self.epoch[slot] = passes + 1
        return self.epoch[0] + passes, passes

    def resumed(self, worker_id: int, num_workers: int, epoch: int) -> None:
        """A worker restored mid-`epoch`: its next pass reads epoch + 1."""
        self.epoch[0] = epoch
        self.epoch[_pass_slot(worker_id, num_workers)] = 1

    def next_epoch(self) -> int:
        """The epoch the next pass reads: set_epoch's value plus the passes run since."""
        return int(self.epoch[0] + np.frombuffer(self.epoch, dtype=np.int64)[1:].max())

    def set_epoch(self, epoch: int) -> None:
        self.epoch[0] = epoch
        ctypes.memset(ctypes.addressof(self.epoch) + 8, 0, 8 * _PASS_SLOTS)

    def add(self, worker_id: int, values: Sequence[float]) -> None:
        base = worker_id * len(_STATS)
        for i, (name, v) in enumerate(zip(_STATS, values)):
            if name in _GAUGES:
                self.stats[base + i] = v
            else:
                self.stats[base + i] += v


class StreamingDataset(torch.utils.data.IterableDataset):
    """Stream samples from tar shards (a dataset folder with index.json, a brace pattern
    such as ``shards-{000000..000009}.tar``, or a list of shard paths or URLs).

    Yields WebDataset-style dicts: ``__key__``, ``__url__`` and one entry per field,
    images decoded as `decode` says ("raw" bytes, "pil", "rgb8" HWC uint8 numpy, "tensor"
    CHW uint8 torch), ``cls`` as int, ``json`` as dict. `transform(sample)` runs in the
    worker and its result is what the DataLoader receives.

    Every rank yields ``len(ds)`` samples per epoch. With ``remainder="repeat"`` (default)
    the last few samples that don't divide evenly are topped up by repeating samples from
    the start of the epoch's order, so none is ever left out; ``"drop"`` leaves a few out.
    With ``shuffle=True`` the order depends only on (seed, epoch) and the layout (world size,
    num_workers); call ``set_epoch`` each epoch, or let each pass advance the epoch by one.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        *,
        shuffle: bool = False,
        seed: int = 0,
        decode: str = "raw",
        transform: Callable[[dict[str, Any]], Any] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        remainder: str = "repeat",
        shuffle_window: int = 1024,
        block: int = 64,
        on_error: str = "raise",
        verify: bool = False,
        prefetch: int = 8,
        prefetch_bytes: int | str = "256MB",
        cache_dir: str | None = None,
        cache_limit: int | str = "20GB",
        storage_options: StorageOptions | None = None,
    ):
        super().__init__()
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
        if remainder not in partition.REMAINDERS:
            raise ValueError(f"remainder must be one of {partition.REMAINDERS}, not {remainder!r}")
        if block < 1 or shuffle_window < 1:
            raise ValueError("block and shuffle_window must be at least 1")
        decoder(decode)  # validate early, in the main process
        self.urls, self.index = resolve(source, storage_options)
        self.shuffle, self.seed, self.decode, self.transform = shuffle, seed, decode, transform
        self.remainder, self.shuffle_window, self.block, self.on_error = remainder, shuffle_window, block, on_error
        self.storage_options, self.verify = storage_options, verify
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0 (0 turns read-ahead off)")
        self.prefetch, self.prefetch_bytes = prefetch, parse_size(prefetch_bytes)
        self.cache_dir, self.cache_limit = cache_dir, parse_size(cache_limit)
        if cache_dir is not None and self.cache_limit < self.prefetch_bytes:
            raise ValueError(
                f"cache_limit ({self.cache_limit} bytes) is smaller than the read-ahead budget prefetch_bytes "
                f"({self.prefetch_bytes} bytes): raise cache_limit or lower prefetch_bytes"
            )
        self._rank_arg, self._world_arg = rank, world_size
        self._world: tuple[int, int] | None = None
        counts = np.array([s.samples for s in self.index.shards], dtype=np.int64)
        self._counts = counts
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._lmdb: str | None = None  # local path of an LMDB dataset
        self._keys = np.empty(0, dtype="S1")
        if self.index.kind == "lmdb":
            self._lmdb = local_lmdb(self.urls[0], storage_options, cache_dir)
            self._keys = np.array(self.index.extra.get("keys", []), dtype="S")
            self._starts = self._ends = np.empty(0, np.int64)
        else:
            offsets = [s.offsets for s in self.index.shards]
            if any(o is None for o in offsets):
                raise ShardkitError(f"{source!r}: index lacks sample offsets; rebuild it with `shardkit index`")
            self._starts = np.concatenate([np.asarray(o[:-1], dtype=np.int64) for o in offsets] or [np.empty(0, np.int64)])
            self._ends = np.concatenate([np.asarray(o[1:], dtype=np.int64) for o in offsets] or [np.empty(0, np.int64)])
        self._shared = _Shared()
        self._resume: dict[str, Any] | None = None

    # ---------------------------------------------------------------- layout

    def _rank_world(self) -> tuple[int, int]:
        if self._world is None:
            return partition.world(self._rank_arg, self._world_arg)
        return self._world

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for spawned workers: pin the rank seen by the main process, because a
        # spawned worker has no process group of its own.
        state = self.__dict__.copy()
        state["_world"] = self._rank_world()
        return state

    def __len__(self) -> int:
        """Samples this rank yields per epoch (the same on every rank)."""
        return partition.per_rank(int(self._counts.sum()), self._rank_world()[1], self.remainder)

    @property
    def classes(self) -> tuple[str, ...]:
        return self.index.classes

    @property
    def epoch(self) -> int:
        return int(self._shared.epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch` for the next pass (reaches persistent workers too)."""
        self._shared.set_epoch(epoch)

    # ---------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """Dataset-level state: the epoch. Mid-epoch progress lives in the worker iterators
        (what StatefulDataLoader saves) or comes from `resume_state` for a plain DataLoader."""
        return {STATE_MARK: 1, "epoch": self._shared.next_epoch()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a StatefulDataLoader state dict, from `resume_state(...)`, or from
        `state_dict()` (epoch only).

        Progress of a whole loader may be loaded under any world size and num_workers: the
        samples that epoch has not yet delivered are split across the new layout. Call it
        in the main process before iterating; the resume applies to the first pass of the
        saved epoch.
        """
        found = _find_states(state)
        workers = [s for s in found if "worker" in s]
        if not found:
            raise ValueError("not a shardkit state dict")
        if torch.utils.data.get_worker_info() is not None:
            return  # inside a worker the iterator restores itself; the dataset has nothing to add
        if not workers:
            self._shared.set_epoch(int(found[0]["epoch"]))
            return
        first = workers[0]
        if any(s["epoch"] != first["epoch"] or s["num_workers"] != first["num_workers"] for s in workers):
            raise ValueError("state dict mixes workers of different epochs or layouts")
        yielded = [0] * int(first["num_workers"])
        for s in workers:
            yielded[int(s["worker"])] = int(s["yielded"])
        progress = Progress(int(first["world_size"]), int(first["num_workers"]), tuple(yielded))
        self._resume = {"epoch": int(first["epoch"]), "history": [*first.get("history", []), progress.to_json()]}
        self._shared.set_epoch(int(first["epoch"]))

    def resume_state(self, *, epoch: int, samples_seen: int, batch_size: int, num_workers: int,
                     world_size: int | None = None, drop_last: bool = False) -> dict[str, Any]:
        """A state for `load_state_dict` after a plain torch DataLoader handed out
        `samples_seen` samples (per rank) of `epoch` with these settings."""
        world = world_size or self._rank_world()[1]
        rank_total = partition.per_rank(int(self._counts.sum()), world, self.remainder)
        workers = max(num_workers, 1)
        sizes = [b - a for a, b in (partition.worker_bounds(rank_total, workers, w) for w in range(workers))]
        yielded = partition.yielded_after(sizes, batch_size, samples_seen, drop_last)
        return {STATE_MARK: 1, "epoch": epoch, "world_size": world, "num_workers": workers, "history": [],
                "workers": [{"worker": w, "yielded": k} for w, k in enumerate(yielded)]}

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Any]:
        rank, world = self._rank_world()
        worker_id, num_workers = partition.worker()
        if num_workers > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} DataLoader workers are supported")
        return _WorkerStream(self, rank, world, worker_id, num_workers)

    def stats(self) -> dict[str, float]:
        """What all workers of this rank did so far: samples, bytes, seconds spent reading
        (waiting for data), decoding and in the transform, skipped samples."""
        arr = np.frombuffer(self._shared.stats, dtype=np.float64).reshape(MAX_WORKERS, len(_STATS))
        total = dict(zip(_STATS, arr.sum(axis=0).tolist()))
        active = arr[:, _STATS.index("prefetch_depth")] > 0
        for name in _GAUGES:  # mean over the workers that reported one
            column = arr[active, _STATS.index(name)]
            total[name] = float(column.mean()) if len(column) else 0.0
        busy = total["read_s"] + total["decode_s"] + total["transform_s"]
        total["read_fraction"] = total["read_s"] / busy if busy else 0.0
        return total


class _Meter:
    """A worker's statistics, pushed to the shared counters every few hundred samples."""

    def __init__(self, shared: _Shared, worker_id: int, reader: storage.RangeReader, cache: RangeCache | None):
        self.values = [0.0] * len(_STATS)
        self._shared, self._worker_id, self._reader, self._cache = shared, worker_id, reader, cache
        self._fetched = self._hits = 0

    def flush(self, prefetcher: Prefetcher[Any] | None) -> None:
        v = self.values
        v[6], self._fetched = self._reader.fetched_bytes - self._fetched, self._reader.fetched_bytes
        if self._cache is not None:
            v[7], self._hits = self._cache.hits - self._hits, self._cache.hits
        if prefetcher is not None:
            v[8], v[9] = prefetcher.target, prefetcher.latency_s
        self._shared.add(self._worker_id, v)
        self.values = [0.0] * len(_STATS)


def _find_states(state: Any) -> list[dict[str, Any]]:
    """Our state dicts anywhere inside `state` (e.g. a StatefulDataLoader state dict)."""
    if isinstance(state, dict):
        if state.get(STATE_MARK) == 1:
            if "workers" in state:  # resume_state(): one dict for all workers
                return [{**state, **w} for w in state["workers"]]
            return [state]
        return [s for v in state.values() for s in _find_states(v)]
    if isinstance(state, (list, tuple)):
        return [s for v in state for s in _find_states(v)]
    return []


class _WorkerStream:
    """One pass of one worker. Stateful (torchdata's protocol): `state_dict()` says how
    many samples this worker has yielded; `load_state_dict()` before the first sample
    skips exactly those."""

    def __init__(self, ds: StreamingDataset, rank: int, world: int, worker_id: int, num_workers: int):
        self.ds, self.rank, self.world, self.worker_id, self.num_workers = ds, rank, world, worker_id, num_workers
        self.epoch, passes = ds._shared.start_pass(worker_id, num_workers)
        resume = ds._resume
        # a loaded resume point applies to the first pass of its epoch only
        resuming = resume is not None and passes == 0 and resume["epoch"] == self.epoch
        self.history = list(resume["history"]) if resuming else []
        self.skip = 0
        self.yielded = 0
        self.prefetcher: Prefetcher[ranges.Range] | None = None  # set once reading starts
        self._gen: Iterator[Any] | None = None

    def __iter__(self) -> _WorkerStream:
        return self

    def __next__(self) -> Any:
        if self._gen is None:
            self._gen = self._generate()
        item = next(self._gen)
        self.yielded += 1
        return item

    def state_dict(self) -> dict[str, Any]:
        return {STATE_MARK: 1, "epoch": self.epoch, "world_size": self.world, "num_workers": self.num_workers,
                "worker": self.worker_id, "yielded": self.skip + self.yielded, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._gen is not None:
            raise RuntimeError("load_state_dict must come before the first sample")
        same = state["world_size"] == self.world and state["num_workers"] == self.num_workers
        if not same or state["worker"] != self.worker_id:
            raise ValueError(
                "this worker state is for another layout; load the whole loader state with "
                "StreamingDataset.load_state_dict to resume under a new world size or num_workers"
            )
        self.epoch, self.history, self.skip = int(state["epoch"]), list(state["history"]), int(state["yielded"])
        self.ds._shared.resumed(self.worker_id, self.num_workers, self.epoch)

    def _plan(self) -> np.ndarray:
        ds = self.ds
        sequence = partition.global_sequence(ds._counts, seed=ds.seed, epoch=self.epoch, shuffle=ds.shuffle, block=ds.block)

        def layout(world: int, workers: int, segment: int) -> Layout:
            return Layout(world, workers, ds.seed, self.epoch, ds.shuffle, ds.shuffle_window, ds.remainder, segment)

        for segment, done in enumerate(self.history):
            p = Progress.from_json(done)
            sequence = partition.remaining(sequence, layout(p.world_size, p.num_workers, segment), p)
        here = layout(self.world, self.num_workers, len(self.history))
        return partition.worker_stream(sequence, here, self.rank, self.worker_id)[self.skip :]

    def _borrow(self, reader: storage.RangeReader, decode: Callable[[dict[str, Any]], Any],
                transform: Callable[[dict[str, Any]], Any] | None, after: int) -> Any:
        """The first usable sample after global id `after` (wrapping), standing in for a
        worker's skipped samples when none of its own could be used: the rank's count stays
        exact. Raises when no sample of the dataset can be used at all."""
        ds = self.ds
        total = int(ds._counts.sum())
        for step in range(1, total + 1):
            i = (after + step) % total
            try:
                if ds._lmdb is None:
                    shard = int(np.searchsorted(ds._first, i, side="right")) - 1
                    start, end = int(ds._starts[i]), int(ds._ends[i])
                    sample = decode(_parse(reader.read(shard, start, end), ds.urls[shard], start))
                else:
                    sample = decode(_from_lmdb(next(self._lmdb_reads(np.array([i])))[2], ds.urls[0], i))
                return transform(sample) if transform is not None else sample
            except Exception:  # noqa: BLE001 - unusable too: try the next one
                continue
        raise CorruptShardError(f"{ds.urls[0]} and the other {len(ds.urls) - 1} shards: no sample could be used")

    def _lmdb_reads(self, ids: np.ndarray) -> Iterator[tuple[int, int, tuple[str, dict[str, bytes]]]]:
        """(0, sample id, (key, fields)) from the LMDB environment, opened in this process."""
        path = self.ds._lmdb
        assert path is not None
        env = lmdb_format.open_reader(path)
        try:
            with env.begin(buffers=True) as txn:
                for i in ids.tolist():
                    key = self.ds._keys[i].decode()
                    yield 0, i, (key, lmdb_format.read_sample(txn, key, path))
        finally:
            env.close()

    def _reads(self, ids: np.ndarray, reader: storage.RangeReader) -> Iterator[tuple[int, int, memoryview]]:
        """(shard, start offset, bytes) of each sample of `ids`, in order, read ahead."""
        ds = self.ds
        shard_of = np.searchsorted(ds._first, ids, side="right") - 1
        starts, ends = ds._starts[ids], ds._ends[ids]
        local = storage.is_local(ds.urls[0])
        if local:
            plan, range_of = ranges.coalesce(shard_of, starts, ends, max_bytes=4 << 20)
        else:
            plan, range_of = ranges.blocks(ids, ds._first, ds._starts, ds._ends, ds.block)
        # a local "read" maps the range and asks the kernel to read it ahead: no threads needed
        self.prefetcher = Prefetcher(plan, lambda r: reader.read(r.shard, r.start, r.stop), lambda r: r.size,
                                     depth=ds.prefetch, budget=ds.prefetch_bytes, threads=not local)
        fetched = iter(self.prefetcher)
        held: dict[int, tuple[ranges.Range, memoryview, list[int]]] = {}  # range index -> range, bytes, samples left
        for r, shard, start, end in zip(range_of.tolist(), shard_of.tolist(), starts.tolist(), ends.tolist()):
            while r not in held:
                got, data = next(fetched)
                held[got.index] = (got, data if isinstance(data, memoryview) else memoryview(data), [got.samples])
            rng, data, left = held[r]
            yield shard, start, data[start - rng.start : end - rng.start]
            left[0] -= 1
            if not left[0]:
                del held[r]

    def _generate(self) -> Iterator[Any]:
        ds = self.ds
        ids = self._plan()
        cache = RangeCache(ds.cache_dir, ds.cache_limit) if ds.cache_dir is not None else None
        versions = [sh.sha256 for sh in ds.index.shards]
        reader = storage.RangeReader(ds.urls, ds.storage_options, versions, cache, verify=ds.verify)
        decode = decoder(ds.decode)
        transform = ds.transform
        pending = 0  # skipped samples still to be replaced, so the rank's count stays exact
        last_good: Any = None
        reads: Iterator[tuple[int, int, Any]]
        if ds._lmdb is None:
            reads, parse = self._reads(ids, reader), _parse
        else:
            reads, parse = self._lmdb_reads(ids), _from_lmdb

        meter = _Meter(ds._shared, self.worker_id, reader, cache)
        try:
            for count in range(1, len(ids) + 1):
                t0 = time.perf_counter()
                shard, start, data = next(reads)
                t1 = time.perf_counter()
                url = ds.urls[shard]
                sample: dict[str, Any] | None = None
                try:
                    sample = decode(parse(data, url, start))
                except Exception as e:  # noqa: BLE001 - bad data, reported with the shard and sample named
                    if ds.on_error == "raise":
                        if isinstance(e, ShardkitError):
                            raise
                        key = sample["__key__"] if sample else _key_of(data)
                        raise CorruptShardError(
                            f"{storage.display(url)}: sample {key} at byte {start}: {type(e).__name__}: {e}"
                        ) from e
                    meter.values[5] += 1
                    pending += 1
                    continue
                t2 = time.perf_counter()
                item = transform(sample) if transform is not None else sample  # user code: its errors are its own
                t3 = time.perf_counter()
                stats = meter.values
                stats[0] += 1
                stats[1] += len(data) if ds._lmdb is None else sum(map(len, data[1].values()))
                stats[2] += t1 - t0
                stats[3] += t2 - t1
                stats[4] += t3 - t2
                for _ in range(pending):
                    yield item
                pending = 0
                last_good = item
                yield item
                if count % 256 == 0:
                    meter.flush(self.prefetcher)
            if pending and last_good is None:  # nothing this worker read could be used
                last_good = self._borrow(reader, decode, transform, int(ids[-1]))
            for _ in range(pending):
                yield last_good
        finally:
            reads.close()
            meter.flush(self.prefetcher)
            reader.close()


def _from_lmdb(data: tuple[str, dict[str, bytes]], url: str, position: int) -> dict[str, Any]:
    key, fields = data
    return {"__key__": key, "__url__": url, **fields}


def _key_of(data: Any) -> str:
    """The key of a sample that could not be parsed, for error messages."""
    if isinstance(data, tuple):  # (key, fields) from LMDB
        return str(data[0])
    return bytes(data[:100]).split(b"\x00", 1)[0].decode("utf-8", "replace").split(".", 1)[0] or "?"


def _parse(data: bytes | memoryview, url: str, start: int) -> dict[str, Any]:
    key, fields = parse_sample(data, f"{storage.display(url)} (sample at byte {start})")
    sample: dict[str, Any] = {"__key__": key, "__url__": url}
    sample.update(fields)
    return sample
