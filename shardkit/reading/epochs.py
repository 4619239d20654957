"""Epochs, layouts and resume state: what StreamingDataset and dataset mixtures share.

An `EpochDataset` knows its rank and world, the epoch (set by `set_epoch` or advanced by
each pass), how many samples a rank yields, and how to save and restore progress. An
`EpochStream` is one pass of one worker: it plans its samples (positions of the epoch's
global sequence, see partition.py), counts what it yields, and skips exactly that on
resume. Subclasses say how a position of the sequence becomes a sample.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch.utils.data

from .. import checks, partition
from . import worker
from .batching import Batches
from .counters import MAX_WORKERS, Shared
from ..partition import Layout, Progress

MAX_EPOCH = 2**32 - 1  # far past any run; a mixture counts epoch x samples of a part in 64 bits

STATE_MARK = "shardkit"  # identifies our state inside a StatefulDataLoader state dict
# The shuffled orders' generation: 2 since shardkit 0.2 (blocks permuted by a Feistel network, windows
# by hashes, mixtures by jittered keys); a state of another generation names other samples.
SHUFFLE_VERSION = 2


class EpochDataset(torch.utils.data.IterableDataset[Any]):
    """Base of the datasets: subclasses define `total_samples()` (samples in an epoch before
    splitting) and `__iter__`. `batch_size` set: the dataset yields batches (see batching.py)."""

    def __init__(self, rank: int | None, world_size: int | None, *, shuffle: bool, seed: int, shuffle_window: int,
                 remainder: str, batch_size: int | None) -> None:
        """Checks and keeps what every epoch dataset's order and layout depend on."""
        super().__init__()
        # explicit ones are checked (and fixed) now; else asked when needed: DDP may start later
        self._world = partition.world(rank, world_size) if rank is not None or world_size is not None else None
        if remainder not in partition.REMAINDERS:
            raise ValueError(f"remainder must be one of {partition.REMAINDERS}, not {remainder!r}")
        self.shuffle, self.remainder = checks.flag("shuffle", shuffle), remainder
        self.seed = checks.integer("seed", seed, None)
        self.shuffle_window = checks.integer("shuffle_window", shuffle_window, 1)
        self.batch_size = checks.optional("batch_size", batch_size, 1)
        self._shared = Shared()
        self._resume: dict[str, Any] | None = None

    def total_samples(self) -> int:
        raise NotImplementedError

    def _segment(self, epoch: int, world: int, workers: int, segment: int, batch: int) -> Layout:
        return Layout(world, workers, self.seed, epoch, self.shuffle, self.shuffle_window, self.remainder, segment, batch)

    def _left(self, epoch: int, history: Sequence[dict[str, Any]]) -> partition.Segments:
        """The epoch's sequence minus what the interrupted segments in `history` delivered."""
        left = partition.Segments(self.total_samples())
        for segment, done in enumerate(history):
            p = Progress.from_json(done)
            left = left.after(self._segment(epoch, p.world_size, p.num_workers, segment, p.batch), p)
        return left

    def stats(self) -> dict[str, float]:
        """What all workers of this rank did so far: samples, bytes, seconds reading (waiting
        for data), decoding and in the transform, skipped samples, `read_fraction`, bytes
        downloaded, cache hits, `throttled` (the store's answers asking for fewer requests,
        503 SlowDown or 429: each one halved a worker's reads in flight and was retried after
        a backoff), the read-ahead's depth and fetch latency."""
        return stats_summary(self._shared.totals())

    def _rank_world(self) -> tuple[int, int]:
        return self._world or partition.world()

    def __getstate__(self) -> dict[str, Any]:
        # Pickled for a spawned worker: pin the rank seen by the main process, because a
        # spawned worker has no process group of its own. Any other copy (deepcopy, a
        # framework shipping the dataset) finds its rank where it runs, as the original does.
        state = self.__dict__.copy()
        if get_spawning_popen() is not None:
            state["_world"] = self._rank_world()
        return state

    def __len__(self) -> int:
        """Samples this rank yields per epoch (the same on every rank); batches, if the
        dataset batches."""
        samples = partition.per_rank(self.total_samples(), self._rank_world()[1], self.remainder)
        return -(-samples // self.batch_size) if self.batch_size else samples

    @property
    def _batch(self) -> int:
        return self.batch_size or 1

    def _order(self) -> dict[str, Any]:
        """What an epoch's order depends on besides the layout: progress saved under other
        values would resume the wrong samples, so a state carries these and must match."""
        order = {"samples": self.total_samples(), "shuffle": bool(self.shuffle), "remainder": self.remainder}
        if self.shuffle:  # without it, the order is the dataset's own, whatever the seed
            order.update(seed=self.seed, shuffle_window=self.shuffle_window, shuffle_version=SHUFFLE_VERSION)
        return order

    def _stream(self, stream: EpochStream) -> Iterator[Any]:
        """What `__iter__` returns: the worker's samples, or its batches."""
        if not self.batch_size:
            return Samples(stream)
        return Batches(stream, self.batch_size)

    @property
    def epoch(self) -> int:
        return int(self._shared.epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Use epoch `epoch` for the next pass (reaches persistent workers too)."""
        epoch = checks.integer("epoch", epoch, 0, MAX_EPOCH)
        resume = self._resume
        if resume is not None and (resume["epoch"] != epoch or self._shared.used_up(resume["token"])):
            self._drop_resume()  # a loaded resume point applies to its own epoch, until a pass used it up
        self._shared.set_epoch(epoch)

    def _drop_resume(self) -> None:
        self._resume = None
        self._shared.drop_resume()

    def _layout(self) -> tuple[int, int, int, int]:
        """(rank, world size, worker id, num_workers) of the process iterating now."""
        rank, world = self._rank_world()
        worker_id, num_workers = partition.worker()
        if num_workers > MAX_WORKERS:
            raise ValueError(f"at most {MAX_WORKERS} DataLoader workers are supported")
        return rank, world, worker_id, num_workers

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
        _check_order(found, self._order())
        if torch.utils.data.get_worker_info() is not None:
            return  # inside a worker the iterator restores itself; the dataset has nothing to add
        if not workers:
            self._drop_resume()
            self._shared.set_epoch(int(found[0]["epoch"]))
            return
        loader = _find_loader(state)
        first = workers[0]
        _check_layout(workers)
        if loader.get("_iterator_finished"):  # StatefulDataLoader, after a whole pass
            self._drop_resume()
            self._shared.set_epoch(int(first["epoch"]) + 1)
            return
        lag = loader.get("_steps_since_snapshot", 0)
        if lag:  # the workers' counts are `lag` batches old, and which worker made each is not recorded
            raise ValueError(
                f"this StatefulDataLoader state was taken {lag} step(s) after its last snapshot of the workers "
                "(snapshot_every_n_steps > 1): resume it under the same layout with the loader's own "
                "load_state_dict, or checkpoint with snapshot_every_n_steps=1 to resume under a new layout "
                "(a loader with in_order=False gives such states too, and no resume of it is exact: "
                "checkpoint with in_order=True, the default)")
        self._resume = {"epoch": int(first["epoch"]), "history": _history(workers), "token": self._shared.new_resume()}
        self._shared.set_epoch(int(first["epoch"]))

    def resume_state(self, *, epoch: int, samples_seen: int, num_workers: int, batch_size: int | None = None,
                     world_size: int | None = None, drop_last: bool = False,
                     resumed_from: dict[str, Any] | None = None) -> dict[str, Any]:
        """A state for `load_state_dict` after a plain torch DataLoader handed out
        `samples_seen` samples (per rank) of `epoch` with these settings. `batch_size` is the
        DataLoader's, or left out when the dataset batches itself. If that pass was itself a
        resumed one, `resumed_from` is the state it was resumed from (counted from there:
        `samples_seen` is what the resumed pass handed out), so the new state carries the
        earlier progress too; such states chain any number of times."""
        epoch, samples_seen = checks.integer("epoch", epoch, 0, MAX_EPOCH), checks.integer("samples_seen", samples_seen, None)
        num_workers, batch_size = checks.integer("num_workers", num_workers), checks.optional("batch_size", batch_size, 1)
        world_size = checks.optional("world_size", world_size, 1)
        if self.batch_size:
            if batch_size not in (None, self.batch_size):
                raise ValueError(f"the dataset batches by {self.batch_size}: leave batch_size out")
            if drop_last:  # DataLoader(batch_size=None) takes no drop_last: its last batch is always handed out
                raise ValueError(f"the dataset batches by {self.batch_size}: leave drop_last out")
            batch_size = self.batch_size
        elif batch_size is None:
            raise ValueError("batch_size: the DataLoader's batch size is needed")
        history: list[dict[str, Any]] = []
        if resumed_from is not None:
            earlier = [s for s in _find_states(resumed_from) if "worker" in s]
            if not earlier or any(s["epoch"] != epoch for s in earlier):
                raise ValueError(f"resumed_from is not a resume state of epoch {epoch}")
            _check_order(earlier, self._order())
            history = _history(earlier)
        elif self._resume is not None and self._resume["epoch"] == epoch:
            raise ValueError("this epoch was itself resumed from a partial state: pass that state as resumed_from")
        world = world_size if world_size is not None else self._rank_world()[1]
        total = self._left(epoch, history).left
        rank_total = partition.per_rank(total, world, self.remainder)
        workers = max(num_workers, 1)
        sizes = [b - a for a, b in (partition.worker_bounds(rank_total, workers, w, self._batch) for w in range(workers))]
        yielded = partition.yielded_after(sizes, batch_size, samples_seen, drop_last)
        if samples_seen == partition.pass_length(sizes, batch_size, drop_last):
            yielded = tuple(sizes)  # a whole pass: what drop_last dropped is done with too
        return {STATE_MARK: 1, "epoch": epoch, "world_size": world, "num_workers": workers, "batch": self._batch,
                "order": self._order(), "history": history,
                "workers": [{"worker": w, "yielded": k} for w, k in enumerate(yielded)]}


def stats_summary(total: dict[str, float]) -> dict[str, float]:
    busy = total["read_s"] + total["decode_s"] + total["transform_s"]
    total["read_fraction"] = total["read_s"] / busy if busy else 0.0
    return total


def _check_layout(workers: list[dict[str, Any]]) -> None:
    first = workers[0]
    if any(s["epoch"] != first["epoch"] or s["num_workers"] != first["num_workers"] for s in workers):
        raise ValueError("state dict mixes workers of different epochs or layouts")
    ids = [int(s["worker"]) for s in workers]
    if len(set(ids)) != len(ids):
        raise ValueError(f"state dict holds {len(ids)} worker states for {first['num_workers']} workers (the states "
                         "of several loaders?): pass the state of this dataset's loader only")


def _history(workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The progress behind a loader's worker states: their own history, then how far they got."""
    _check_layout(workers)
    first = workers[0]
    yielded = [0] * int(first["num_workers"])
    for s in workers:
        yielded[int(s["worker"])] = int(s["yielded"])
    progress = Progress(int(first["world_size"]), int(first["num_workers"]), tuple(yielded), int(first.get("batch", 1)))
    return [*first.get("history", []), progress.to_json()]


def _dicts(state: Any) -> Iterator[dict[str, Any]]:
    """Every dict inside `state`, itself included, depth first (not inside our own states)."""
    if isinstance(state, dict):
        yield state
        if state.get(STATE_MARK) == 1:
            return
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        for value in state:
            yield from _dicts(value)


def _find_loader(state: Any) -> dict[str, Any]:
    """The StatefulDataLoader state dict inside `state` (a training checkpoint may nest
    it), or {}."""
    loaders = [d for d in _dicts(state) if "_iterator_finished" in d or "_steps_since_snapshot" in d]
    if len(loaders) > 1:
        raise ValueError(f"this state holds the states of {len(loaders)} DataLoaders: pass the state of this "
                         "dataset's loader only")
    return loaders[0] if loaders else {}


def _find_states(state: Any) -> list[dict[str, Any]]:
    """Our state dicts anywhere inside `state` (e.g. a StatefulDataLoader state dict)."""
    found: list[dict[str, Any]] = []
    for d in _dicts(state):
        if d.get(STATE_MARK) == 1:  # resume_state() has one dict for all workers
            if "workers" in d and not (isinstance(d["workers"], (list, tuple))
                                       and all(isinstance(w, dict) for w in d["workers"])):
                raise ValueError("not a valid shardkit state: 'workers' must be a list of dicts")
            found += [{**d, **w} for w in d["workers"]] if "workers" in d else [d]
    for s in found:
        _check_state(s)
    return found


def _check_state(s: dict[str, Any]) -> None:
    """Refuse a state whose values could not have come from a pass: one line saying which."""
    try:
        checks.integer("epoch", s["epoch"], 0, MAX_EPOCH)
        if not isinstance(s.get("order", {}), dict):
            raise TypeError("order must be a dict")
        for h in s.get("history", []):
            Progress.from_json(h)
        if "worker" in s:
            workers = checks.integer("num_workers", s["num_workers"], 1)
            checks.integer("worker", s["worker"], 0, workers - 1)
            checks.integer("world_size", s["world_size"], 1)
            checks.integer("yielded", s["yielded"], 0)
            checks.integer("batch", s.get("batch", 1), 1)
            if not isinstance(s.get("history", []), (list, tuple)):
                raise TypeError("history must be a list")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a valid shardkit state ({type(e).__name__}: {e})") from None


def _check_order(found: list[dict[str, Any]], order: dict[str, Any]) -> None:
    """Refuse progress saved from a dataset whose epochs have another order (another
    dataset, seed, shuffle, ...): it would resume the wrong samples. What a state saved by
    an earlier shardkit version did not record (all of it, or a mixture's parts) is taken
    as it is, but for the shuffle version: a shuffled order that records none is of the
    first generation, whose samples sit elsewhere."""
    saved = next((s["order"] for s in found if "order" in s), None)
    if saved is None:
        return
    differ = [k for k in saved if k != "shuffle_version" and not _same(saved[k], order.get(k))]
    if differ:
        said = ", ".join(f"{k} {saved[k]!r} there, {order.get(k)!r} here" for k in differ)
        raise ValueError(f"this state was saved from a dataset whose epochs have another order ({said})")
    if saved.get("shuffle_version") != order.get("shuffle_version"):
        raise ValueError(
            f"this state was saved by a shardkit whose shuffled order differs from this one's (shuffle version "
            f"{saved.get('shuffle_version', 1)}, here {order.get('shuffle_version')}): its counts would resume other "
            "samples; finish that epoch with the shardkit that saved it, or start the epoch over "
            "(load_state_dict({'shardkit': 1, 'epoch': N}))")


def _same(saved: Any, here: Any) -> bool:
    """Whether a saved value of the order matches this dataset's: a mixture's parts item by
    item, on the keys the saved part has (an earlier version recorded fewer)."""
    if isinstance(saved, list) and isinstance(here, list) and all(isinstance(x, dict) for x in saved + here):
        return len(saved) == len(here) and all(all(a[k] == b.get(k) for k in a) for a, b in zip(saved, here))
    return bool(saved == here)


class Samples:
    """What a pass hands the DataLoader: the stream's samples, and the stream closed as
    soon as the DataLoader lets go of it. A stream and its running generator reference
    each other, so a pass abandoned halfway (a `break` out of the loop) would otherwise keep
    its read-ahead threads, buffers and open files until a full garbage collection."""

    def __init__(self, stream: EpochStream):
        self.stream = stream

    def __iter__(self) -> Samples:
        return self

    def __next__(self) -> Any:
        return next(self.stream)

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)

    def __del__(self) -> None:
        self.stream.close()


class EpochStream:
    """One pass of one worker. Stateful (torchdata's protocol): `state_dict()` says how
    many samples this worker has yielded; `load_state_dict()` before the first sample
    skips exactly those. `fixed` gives the positions outright (a part of a mixture)."""

    def __init__(self, ds: EpochDataset, rank: int, world: int, worker_id: int, num_workers: int,
                 fixed: np.ndarray | None = None):
        self.ds, self.rank, self.world, self.worker_id, self.num_workers = ds, rank, world, worker_id, num_workers
        self._fixed = fixed
        self._order = ds._order()  # a state carries it: asked once, not at every batch's snapshot
        # raised at the first sample, not here: torch reports an error from a persistent
        # worker's __iter__ only as the worker dying
        self._refusal: Exception | None = None
        worker.settle()
        self.history: list[dict[str, Any]] = []
        self.epoch = 0
        self.skip = 0
        self.yielded = 0
        self._gen: Generator[Any, None, None] | None = None
        self._resume_token = 0  # the resume point this pass follows, if any
        # the pass counters' layout: the DataLoader's num_workers, 0 in the main process
        self._layout = num_workers if torch.utils.data.get_worker_info() is not None else 0
        if fixed is None:
            resume, in_force = ds._resume, ds._shared.resume[0]
            if in_force and (resume is None or resume["token"] != in_force):
                self._refusal = RuntimeError(  # and the refused pass is not counted
                    "the dataset's load_state_dict was called after this DataLoader's persistent workers "
                    "started, and they keep the dataset they started with: load the state before the "
                    "loader's first iteration, or build a new DataLoader")
                return
            self.epoch, passes = ds._shared.start_pass(worker_id, self._layout)
            # a loaded resume point applies to the first pass of its epoch of each layout: a
            # DataLoader worker's pass uses it up as it starts, a pass in the main process (a
            # peek at one sample, or num_workers=0) only if it runs to its end
            if resume is not None and resume["token"] == in_force and passes == 0 and resume["epoch"] == self.epoch:
                self.history = list(resume["history"])
                self._resume_token = in_force
                if self._layout:
                    ds._shared.use_up(in_force)

    def __iter__(self) -> EpochStream:
        return self

    def __next__(self) -> Any:
        if self._gen is None:
            if self._refusal is not None:
                raise self._refusal
            self._gen = self._generate()
        try:
            item = next(self._gen)
        except StopIteration:
            if self._fixed is None and not self._layout:  # a whole pass in the main process
                self.ds._shared.ended_in_main()
                if self._resume_token:
                    self.ds._shared.use_up(self._resume_token)
            raise
        self.yielded += 1
        return item

    def _generate(self) -> Generator[Any, None, None]:
        raise NotImplementedError

    def close(self) -> None:
        """End the pass now: the generator's `finally` releases its threads, buffers and files."""
        if self._gen is not None:
            self._gen.close()

    def state_dict(self) -> dict[str, Any]:
        return {STATE_MARK: 1, "epoch": self.epoch, "world_size": self.world, "num_workers": self.num_workers,
                "batch": self.ds._batch, "worker": self.worker_id, "yielded": self.skip + self.yielded,
                "order": self._order, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._gen is not None:
            raise RuntimeError("load_state_dict must come before the first sample")
        (state,) = _find_states(state)
        _check_order([state], self._order)
        same = (state["world_size"] == self.world and state["num_workers"] == self.num_workers
                and state.get("batch", 1) == self.ds._batch)
        if not same or state["worker"] != self.worker_id:
            raise ValueError(
                "this worker state is for another layout; load the whole loader state with "
                "the dataset's load_state_dict to resume under a new world size or num_workers"
            )
        self.epoch, self.history, self.skip = int(state["epoch"]), list(state["history"]), int(state["yielded"])
        self.ds._shared.resumed(self.worker_id, self._layout, self.epoch)

    def _plan(self) -> np.ndarray:
        """This worker's positions in the epoch's sequence for this pass, in order, minus
        those already yielded (or the `fixed` ones)."""
        if self._fixed is not None:
            return self._fixed
        ds = self.ds
        here = ds._segment(self.epoch, self.world, self.num_workers, len(self.history), ds._batch)
        left = ds._left(self.epoch, self.history)
        return left.base(partition.worker_positions(left.left, here, self.rank, self.worker_id)[self.skip :])
