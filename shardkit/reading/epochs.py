"""Epochs, layouts and resume: what StreamingDataset and dataset mixtures share.

An `EpochDataset` knows its rank and world, the epoch (set by `set_epoch` or advanced by
each pass), how many samples a rank yields, and how to save and restore progress (the
state's schema is state.py's; reading a saved one and writing a resume state, resume.py's).
Each pass of a worker is an `EpochStream` (epoch_stream.py), made by `_epoch_stream` from
the dataset's frozen `Ordering`; a subclass says, by the `run` it gives, how positions of the sequence become samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from multiprocessing.context import get_spawning_popen
from typing import Any

import torch.utils.data

from .. import checks
from ..order import globalbatch, partition
from . import resume, state
from .batching import Batches
from .counters import MAX_WORKERS, Shared
from .epoch_stream import EpochStream, Run, Samples
from .ordering import Ordering


class EpochDataset(torch.utils.data.IterableDataset[Any]):
    """Base of the datasets: subclasses define `total_samples()` (samples in an epoch before
    splitting) and `__iter__`. `batch_size` set: the dataset yields batches (see batching.py)."""

    def __init__(
        self,
        rank: int | None,
        world_size: int | None,
        *,
        shuffle: bool,
        seed: int,
        shuffle_window: int,
        remainder: str,
        batch_size: int | None,
        global_batch_size: int | None = None,
    ) -> None:
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
        self.global_batch_size = checks.optional("global_batch_size", global_batch_size, 1)
        self._shared = Shared()
        self._opened = {"hedges": 0, "hedge_wins": 0, "throttled": 0}  # what opening it counted (stats())
        self._resume: dict[str, Any] | None = None
        if self.global_batch_size:  # a world size known now (given, or torchrun's) must split it
            self._local_batch(self._rank_world()[1])

    def _local_batch(self, world: int) -> int:
        """B / W under global_batch_size=B, checked: W must divide B, and a dataset that
        batches itself must batch by B / W."""
        b = globalbatch.local_size(self.global_batch_size or 1, world)
        if self.batch_size not in (None, b):
            raise ValueError(
                f"batch_size={self.batch_size} with global_batch_size={self.global_batch_size} over "
                f"{world} ranks: each rank's batches hold {b} samples (leave batch_size out, or pass {b})"
            )
        return b

    @property
    def local_batch_size(self) -> int | None:
        """Under global_batch_size=B: B / world size, the batch_size to give the DataLoader."""
        return self._local_batch(self._rank_world()[1]) if self.global_batch_size else None

    def _piece(self) -> int:
        """Consecutive positions a global batch takes together (see globalbatch.py)."""
        return 32

    def _bounds(self) -> Callable[[int], globalbatch.Bounds] | None:
        """Where an epoch's blocks lie in its sequence, if it has blocks (see globalbatch.py)."""
        return None

    def total_samples(self) -> int:
        raise NotImplementedError

    def _ordering(self) -> Ordering:
        """The values a pass's plan and state follow, fixed as it starts."""
        return Ordering(
            self.total_samples(),
            self.seed,
            self.shuffle,
            self.shuffle_window,
            self.remainder,
            self._batch,
            self.order_key(),
            self.global_batch_size or 0,
            self._piece(),
            self._bounds(),
        )

    def _epoch_stream(self, rank: int, world: int, worker_id: int, num_workers: int, run: Run) -> EpochStream:
        """A pass of this worker whose positions become samples by `run`."""
        return EpochStream(self._ordering(), self._shared, self._resume, rank, world, worker_id, num_workers, run)

    def stats(self) -> dict[str, Any]:
        """What all workers of this rank did so far: samples, bytes, seconds reading (waiting
        for data), decoding and in the transform, skipped samples, `read_fraction`, bytes
        downloaded, cache hits, `throttled` (the store's answers asking for fewer requests,
        503 SlowDown or 429, the opening reads' included: each was retried after a backoff,
        and each a ranged read met halved its worker's reads in flight), `requests` (ranged
        GETs sent, hedges aside), `hedges` (GETs sent again because their first byte was
        late, the dataset's opening reads of its index and offsets file included) and
        `hedge_wins` (those that answered first), the
        read-ahead's depth and fetch latency, `store`: which client reads the shards, and
        `store_config`: what was decided for each store (`store_config()`)."""
        total = self._shared.totals()
        for name, n in self._opened.items():
            total[name] += n
        return {**stats_summary(total), "store": self.store_name(), "store_config": self.store_config()}

    def store_name(self) -> str:
        """The client that reads this dataset's shards ("local", "s3 (presigned)", "s3fs", ...)."""
        raise NotImplementedError

    def store_config(self) -> list[dict[str, str]]:
        """What was decided for the stores that read the shards, one dict per distinct
        configuration (one, mostly): "store" (the client, as `store_name`) and, for S3,
        "endpoint", "addressing", "region", "checksums" and "client" (why that client)."""
        raise NotImplementedError

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
        world = self._rank_world()[1]
        if self.global_batch_size:
            samples = self._ordering().global_batches(0).batches * self._local_batch(world)
        else:
            samples = partition.per_rank(self.total_samples(), world, self.remainder)
        return -(-samples // self.batch_size) if self.batch_size else samples

    @property
    def _batch(self) -> int:
        return self.batch_size or 1

    def order_key(self) -> dict[str, Any]:
        """What an epoch's order depends on besides the layout: progress saved under other
        values would resume the wrong samples, so a state carries these and must match."""
        order = {"samples": self.total_samples(), "shuffle": bool(self.shuffle), "remainder": self.remainder}
        if self.shuffle:  # without it, the order is the dataset's own, whatever the seed
            order.update(seed=self.seed, shuffle_window=self.shuffle_window, shuffle_version=state.SHUFFLE_VERSION)
        if self.global_batch_size:
            order.update(global_batch_size=self.global_batch_size, piece=self._piece())
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
        epoch = checks.integer("epoch", epoch, 0, state.MAX_EPOCH)
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
        if self.global_batch_size:
            self._local_batch(world)
        return rank, world, worker_id, num_workers

    def state_dict(self) -> dict[str, Any]:
        """Dataset-level state: the epoch. Mid-epoch progress lives in the worker iterators
        (what StatefulDataLoader saves) or comes from `resume_state` for a plain DataLoader."""
        return state.epoch_state(self._shared.next_epoch())

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Resume from a StatefulDataLoader state dict, from `resume_state(...)`, or from
        `state_dict()` (epoch only).

        Progress of a whole loader may be loaded under any world size and num_workers: the
        samples that epoch has not yet delivered are split across the new layout. Call it
        in the main process before iterating; the resume applies to the first pass of the
        saved epoch.
        """
        found = state.find_states(saved)
        if not found:
            raise ValueError("not a shardkit state dict")
        state.check_order(found, self.order_key())
        if torch.utils.data.get_worker_info() is not None:
            return  # inside a worker the iterator restores itself; the dataset has nothing to add
        epoch, history = resume.loaded(saved, found, self._ordering, self.batch_size)
        if history is None:
            self._drop_resume()
        else:
            self._resume = {"epoch": epoch, "history": history, "token": self._shared.new_resume()}
        self._shared.set_epoch(epoch)

    def resume_state(
        self,
        *,
        epoch: int,
        samples_seen: int,
        num_workers: int,
        batch_size: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        resumed_from: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A state for `load_state_dict` after a plain torch DataLoader handed out
        `samples_seen` samples (per rank) of `epoch` with these settings. `batch_size` is the
        DataLoader's, or left out when the dataset batches itself. If that pass was itself a
        resumed one, `resumed_from` is the state it was resumed from (counted from there:
        `samples_seen` is what the resumed pass handed out), so the new state carries the
        earlier progress too; such states chain any number of times."""
        epoch = checks.integer("epoch", epoch, 0, state.MAX_EPOCH)
        samples_seen = checks.integer("samples_seen", samples_seen, None)
        num_workers, batch_size = (
            checks.integer("num_workers", num_workers),
            checks.optional("batch_size", batch_size, 1),
        )
        world_size = checks.optional("world_size", world_size, 1)
        if self.batch_size:
            if batch_size not in (None, self.batch_size):
                raise ValueError(f"the dataset batches by {self.batch_size}: leave batch_size out")
            if drop_last:  # DataLoader(batch_size=None) takes no drop_last: its last batch is always handed out
                raise ValueError(f"the dataset batches by {self.batch_size}: leave drop_last out")
            batch_size = self.batch_size
        elif batch_size is None:
            raise ValueError("batch_size: the DataLoader's batch size is needed")
        world = world_size if world_size is not None else self._rank_world()[1]
        if self.global_batch_size and batch_size != self._local_batch(world):
            raise ValueError(
                f"batch_size={batch_size}: under global_batch_size={self.global_batch_size} over {world} "
                f"ranks the DataLoader's batch_size is {self._local_batch(world)}"
            )
        return resume.loader_state(
            self._ordering(),
            epoch=epoch,
            samples_seen=samples_seen,
            num_workers=num_workers,
            batch_size=batch_size,
            batch=self._batch,
            world=world,
            rank_of=lambda: self._rank_world()[0],
            drop_last=drop_last,
            resumed_from=resumed_from,
            resumed=self._resume,
        )


def stats_summary(total: dict[str, float]) -> dict[str, float]:
    busy = total["read_s"] + total["decode_s"] + total["transform_s"]
    total["read_fraction"] = total["read_s"] / busy if busy else 0.0
    return total


def distinct(configs: Iterable[dict[str, str]]) -> list[dict[str, str]]:
    """Each store configuration once, in the order first seen (a dataset's shards share one, mostly)."""
    out: list[dict[str, str]] = []
    for c in configs:
        if c not in out:
            out.append(c)
    return out
