"""One pass of one worker, as the epochs see it: which positions of the epoch's global
sequence it yields (partition.py), how many it has yielded, and how it resumes.

An `EpochStream` is built from an `Ordering` (the frozen values the epoch's order and
split depend on), the dataset's shared counters, a loaded resume point, the worker's place
(rank, world, worker id, num_workers) and `run`, which turns (epoch, positions) into the
samples (a Pass of pass_.py, or a mixture's). It never sees the dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.utils.data

from .. import globalbatch, partition
from ..partition import Layout, Progress
from . import state, worker
from .counters import Shared

Run = Callable[[int, Iterator[np.ndarray]], Generator[Any, None, None]]  # (epoch, pieces of positions) -> samples


@dataclass(frozen=True, eq=False)
class Ordering:
    """What an epoch's sequence and its split over ranks and workers depend on, besides
    the layout; `key` is what a saved state carries of it (and must match to resume)."""

    total: int  # samples in an epoch, before splitting
    seed: int
    shuffle: bool
    shuffle_window: int
    remainder: str
    batch: int  # samples a batch when the dataset batches, else 1
    key: dict[str, Any]
    global_batch: int = 0  # B of global_batch_size (0: the default order)
    piece: int = 32  # consecutive positions a global batch takes together (global batches only)

    def global_batches(self, epoch: int) -> globalbatch.GlobalBatches:
        return globalbatch.plan(self.total, self.global_batch, remainder=self.remainder, shuffle=self.shuffle,
                                window=self.shuffle_window, piece=self.piece, seed=self.seed, epoch=epoch)

    def batches_before(self, history: Sequence[dict[str, Any]]) -> int:
        """Global batches that the interrupted segments in `history` delivered."""
        done = 0
        for entry in history:
            p = Progress.from_json(entry)
            done += globalbatch.batches_done(p.num_workers, p.yielded, globalbatch.local_size(self.global_batch,
                                                                                              p.world_size))
        return done

    def per_rank(self, epoch: int, history: Sequence[dict[str, Any]], world: int) -> int:
        """Samples each rank yields in a pass that follows `history`."""
        if self.global_batch:
            gb = self.global_batches(epoch)
            return (gb.batches - self.batches_before(history)) * globalbatch.local_size(self.global_batch, world)
        return partition.per_rank(self.left(epoch, history).left, world, self.remainder)

    def worker_sizes(self, epoch: int, history: Sequence[dict[str, Any]], world: int, workers: int) -> list[int]:
        """Samples each worker of a rank yields in a pass that follows `history`."""
        if self.global_batch:
            b = globalbatch.local_size(self.global_batch, world)
            left = self.per_rank(epoch, history, world) // b
            return [b * globalbatch.worker_batches(left, workers, w) for w in range(workers)]
        rank_total = self.per_rank(epoch, history, world)
        bounds = (partition.worker_bounds(rank_total, workers, w, self.batch) for w in range(workers))
        return [b - a for a, b in bounds]

    def segment(self, epoch: int, world: int, workers: int, segment: int, batch: int) -> Layout:
        return Layout(world, workers, self.seed, epoch, self.shuffle, self.shuffle_window, self.remainder, segment, batch)

    def left(self, epoch: int, history: Sequence[dict[str, Any]]) -> partition.Segments:
        """The epoch's sequence minus what the interrupted segments in `history` delivered."""
        left = partition.Segments(self.total)
        for segment, done in enumerate(history):
            p = Progress.from_json(done)
            left = left.after(self.segment(epoch, p.world_size, p.num_workers, segment, p.batch), p)
        return left


class EpochStream:
    """One pass of one worker. Stateful (torchdata's protocol): `state_dict()` says how
    many samples this worker has yielded; `load_state_dict()` before the first sample
    skips exactly those."""

    def __init__(self, ordering: Ordering, shared: Shared, resume: dict[str, Any] | None, rank: int, world: int,
                 worker_id: int, num_workers: int, run: Run):
        self.ordering, self.shared, self.run = ordering, shared, run
        self.rank, self.world, self.worker_id, self.num_workers = rank, world, worker_id, num_workers
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
        in_force = shared.resume[0]
        if in_force and (resume is None or resume["token"] != in_force):
            self._refusal = RuntimeError(  # and the refused pass is not counted
                "the dataset's load_state_dict was called after this DataLoader's persistent workers "
                "started, and they keep the dataset they started with: load the state before the "
                "loader's first iteration, or build a new DataLoader")
            return
        self.epoch, passes = shared.start_pass(worker_id, self._layout)
        # a loaded resume point applies to the first pass of its epoch of each layout: a
        # DataLoader worker's pass uses it up as it starts, a pass in the main process (a
        # peek at one sample, or num_workers=0) only if it runs to its end
        if resume is not None and resume["token"] == in_force and passes == 0 and resume["epoch"] == self.epoch:
            self.history = list(resume["history"])
            self._resume_token = in_force
            if self._layout:
                shared.use_up(in_force)

    def __iter__(self) -> EpochStream:
        return self

    def __next__(self) -> Any:
        if self._gen is None:
            if self._refusal is not None:
                raise self._refusal
            self._gen = self.run(self.epoch, self._chunks())
        try:
            item = next(self._gen)
        except StopIteration:
            if not self._layout:  # a whole pass in the main process
                self.shared.ended_in_main()
                if self._resume_token:
                    self.shared.use_up(self._resume_token)
            raise
        self.yielded += 1
        return item

    def close(self) -> None:
        """End the pass now: the generator's `finally` releases its threads, buffers and files."""
        if self._gen is not None:
            self._gen.close()

    def state_dict(self) -> dict[str, Any]:
        return state.worker_state(self.epoch, self.world, self.num_workers, self.ordering.batch, self.worker_id,
                                  self.skip + self.yielded, self.ordering.key, self.history)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self._gen is not None:
            raise RuntimeError("load_state_dict must come before the first sample")
        (found,) = state.find_states(saved)
        state.check_order([found], self.ordering.key)
        same = (found[state.WORLD_SIZE] == self.world and found[state.NUM_WORKERS] == self.num_workers
                and found.get(state.BATCH, 1) == self.ordering.batch)
        if not same or found[state.WORKER] != self.worker_id:
            raise ValueError(
                "this worker state is for another layout; load the whole loader state with "
                "the dataset's load_state_dict to resume under a new world size or num_workers"
            )
        self.epoch, self.history = int(found[state.EPOCH]), list(found[state.HISTORY])
        self.skip = int(found[state.YIELDED])
        self.shared.resumed(self.worker_id, self._layout, self.epoch)

    def _chunks(self) -> Iterator[np.ndarray]:
        """This worker's positions in the epoch's sequence for this pass, in order, minus
        those already yielded: made a piece at a time, as the pass needs them."""
        o = self.ordering
        if o.global_batch:
            gb = o.global_batches(self.epoch)
            yield from globalbatch.worker_chunks(gb, o.batches_before(self.history), self.world, self.rank,
                                                 self.num_workers, self.worker_id, self.skip)
            return
        here = o.segment(self.epoch, self.world, self.num_workers, len(self.history), o.batch)
        left = o.left(self.epoch, self.history)
        for piece in partition.worker_chunks(left.left, here, self.rank, self.worker_id, self.skip):
            yield left.base(piece)

    def _plan(self) -> np.ndarray:
        """All of `_chunks` at once (tests, benchmarks)."""
        return np.concatenate([np.empty(0, dtype=np.int64), *self._chunks()])


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

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.stream.load_state_dict(saved)

    def __del__(self) -> None:
        self.stream.close()
