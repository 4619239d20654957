"""One pass of one worker, as the epochs see it: which positions of the epoch's global
sequence it yields (partition.py), how many it has yielded, and how it resumes.

An `EpochStream` is built from an `Ordering` (the frozen values the epoch's order and
split depend on), the dataset's shared counters, a loaded resume point, the worker's place
(rank, world, worker id, num_workers) and `run`, which turns (epoch, positions) into the
samples (a Pass of pass_.py, or a mixture's). It never sees the dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import torch.utils.data

from ..order import digest, globalbatch, partition
from ..order.progress import Progress
from . import state, worker
from .counters import Shared
from .ordering import Ordering, where

Run = Callable[[int, Iterator[np.ndarray]], Generator[Any, None, None]]  # (epoch, pieces of positions) -> samples


class EpochStream:
    """One pass of one worker. Stateful (torchdata's protocol): `state_dict()` says how
    many samples this worker has yielded; `load_state_dict()` before the first sample
    skips exactly those."""

    def __init__(
        self,
        ordering: Ordering,
        shared: Shared,
        resume: dict[str, Any] | None,
        rank: int,
        world: int,
        worker_id: int,
        num_workers: int,
        run: Run,
    ):
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
        self._done = digest.ZERO  # fingerprint of the positions delivered, but those of `_pieces`
        self._pieces: list[tuple[int, np.ndarray]] = []  # (index in the pass, positions) not yet all delivered
        self._resume_token = 0  # the resume point this pass follows, if any
        # the pass counters' layout: the DataLoader's num_workers, 0 in the main process
        self._layout = num_workers if torch.utils.data.get_worker_info() is not None else 0
        in_force = shared.resume[0]
        if in_force and (resume is None or resume["token"] != in_force):
            self._refusal = RuntimeError(  # and the refused pass is not counted
                "the dataset's load_state_dict was called after this DataLoader's persistent workers "
                "started, and they keep the dataset they started with: load the state before the "
                "loader's first iteration, or build a new DataLoader"
            )
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
            self._check_end()
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
        saved = state.worker_state(
            self.epoch,
            self.world,
            self.num_workers,
            self.ordering.batch,
            self.worker_id,
            self.skip + self.yielded,
            self.ordering.key,
            self.history,
        )
        saved[state.DIGEST] = state.digest_entry(self.rank, digest.text(self._delivered()))
        return saved

    def _delivered(self) -> digest.Digest:
        """The fingerprint of the positions (slots, under global batches) this worker has
        delivered in this segment, worked out from those it did deliver."""
        while self._pieces and self._pieces[0][0] + len(self._pieces[0][1]) <= self.yielded:
            self._done = digest.add(self._done, digest.of_positions(self._pieces.pop(0)[1]))
        partly = [digest.of_positions(p[: max(0, self.yielded - at)]) for at, p in self._pieces]
        return digest.add(self._done, *partly)

    def _check_end(self) -> None:
        """At the end of the pass: what it delivered is what its share is, by the spans' arithmetic."""
        o = self.ordering
        sizes = o.worker_sizes(self.epoch, self.history, self.world, self.num_workers)
        full = Progress(self.world, self.num_workers, tuple(sizes), o.batch)
        if self.skip + self.yielded != sizes[self.worker_id] or self._delivered() != o.fingerprint(
            self.epoch, self.history, full, self.rank, self.worker_id
        ):
            a, z = o.delivered(self.epoch, self.history, full, self.rank, self.worker_id)
            raise RuntimeError(
                f"{where(a, z, self.epoch)}: worker {self.worker_id} of rank {self.rank} delivered "
                f"{self.skip + self.yielded} samples that are not its share of the epoch "
                f"({sizes[self.worker_id]}): samples there were repeated or skipped"
            )

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self._gen is not None:
            raise RuntimeError("load_state_dict must come before the first sample")
        (found,) = state.find_states(saved)
        state.check_order([found], self.ordering.key)
        same = (
            found[state.WORLD_SIZE] == self.world
            and found[state.NUM_WORKERS] == self.num_workers
            and found.get(state.BATCH, 1) == self.ordering.batch
        )
        if not same or found[state.WORKER] != self.worker_id:
            raise ValueError(
                "this worker state is for another layout; load the whole loader state with "
                "the dataset's load_state_dict to resume under a new world size or num_workers"
            )
        self.epoch, self.history = int(found[state.EPOCH]), list(found[state.HISTORY])
        self.ordering.check_history(self.epoch, self.history)
        self.ordering.check_worker(self.epoch, self.history, found)
        self.skip = int(found[state.YIELDED])
        if state.DIGEST in found:
            self._done = digest.parse(found[state.DIGEST][state.SUMS])
        elif self.skip:  # an earlier version's state: what it delivered is taken as its count says
            self._done = self.ordering.fingerprint(
                self.epoch,
                self.history,
                Progress(
                    self.world,
                    self.num_workers,
                    tuple(self.skip * (i == self.worker_id) for i in range(self.num_workers)),
                    self.ordering.batch,
                ),
                self.rank,
                self.worker_id,
            )
        self.shared.resumed(self.worker_id, self._layout, self.epoch)

    def _chunks(self) -> Iterator[np.ndarray]:
        """This worker's positions in the epoch's sequence for this pass, in order, minus
        those already yielded: made a piece at a time, as the pass needs them."""
        at = 0
        for coords, positions in self._pieces_of_plan():
            self._pieces.append((at, coords))
            at += len(coords)
            yield positions

    def _pieces_of_plan(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(what the fingerprint counts, positions) of each piece of the plan: the positions
        themselves, or under global batches their slots."""
        o = self.ordering
        if o.global_batch:
            gb = o.global_batches(self.epoch)
            for slots in globalbatch.worker_slots(
                gb, o.batches_before(self.history), self.world, self.rank, self.num_workers, self.worker_id, self.skip
            ):
                yield slots, gb.positions(slots)
            return
        here = o.segment(self.epoch, self.world, self.num_workers, len(self.history), o.batch)
        left = o.left(self.epoch, self.history)
        for piece in partition.worker_chunks(left.left, here, self.rank, self.worker_id, self.skip):
            positions = left.base(piece)
            yield positions, positions

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
