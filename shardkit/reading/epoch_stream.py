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

from .. import digest, globalbatch, partition
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
    # where an epoch's blocks lie (epoch -> (lo, hi) -> blocks): a global batch's pieces are their halves
    bounds: Callable[[int], globalbatch.Bounds] | None = None

    def global_batches(self, epoch: int) -> globalbatch.GlobalBatches:
        bounds = self.bounds(epoch) if self.bounds is not None and self.shuffle else None
        return globalbatch.plan(self.total, self.global_batch, remainder=self.remainder, shuffle=self.shuffle,
                                window=self.shuffle_window, piece=self.piece, seed=self.seed, epoch=epoch,
                                bounds=bounds)

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

    def fingerprint(self, epoch: int, history: Sequence[dict[str, Any]], progress: Progress, rank: int | None = None,
               worker_id: int | None = None) -> digest.Digest:
        """The fingerprint of what `progress` delivered after `history` (of one rank, or one
        worker, if given): epoch positions, or slots of the global batches."""
        a, z = self.delivered(epoch, history, progress, rank, worker_id)
        return digest.of_spans(a, z)

    def delivered(self, epoch: int, history: Sequence[dict[str, Any]], progress: Progress, rank: int | None = None,
                  worker_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The spans behind `fingerprint`."""
        if self.global_batch:
            start, size = self.batches_before(history), self.global_batch
            b = globalbatch.local_size(size, progress.world_size)
            if rank is None:  # all ranks together: the batches delivered, whole
                done = globalbatch.batches_done(progress.num_workers, progress.yielded, b)
                return np.array([start * size]), np.array([(start + done) * size])
            starts, stops = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=np.int64)]
            for w, k in enumerate(progress.yielded):
                if worker_id is None or w == worker_id:
                    first = globalbatch.slot_spans(size, start, b, rank, progress.num_workers, w, 0, -(-k // b))
                    ends = first + b
                    if k % b:
                        ends[-1] = first[-1] + k % b
                    starts.append(first)
                    stops.append(ends)
            return np.concatenate(starts), np.concatenate(stops)
        left = self.left(epoch, history)
        if not left.left:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        layout = self.segment(epoch, progress.world_size, progress.num_workers, len(history), progress.batch)
        a, z = partition.wrapped(*partition.delivered(left.left, layout, progress, rank, worker_id), left.left)
        return left.base_spans(a, z)

    def record(self, epoch: int, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`history` with each segment's fingerprint (of all ranks' deliveries), the last one
        worked out now, the earlier ones checked."""
        self.check_history(epoch, history[:-1])
        last = dict(history[-1])
        last[state.DIGEST] = digest.text(self.fingerprint(epoch, history[:-1], Progress.from_json(last)))
        return [*history[:-1], last]

    def check_history(self, epoch: int, history: Sequence[dict[str, Any]]) -> None:
        """Refuse a history whose counts are not those its fingerprints were made from."""
        for i, entry in enumerate(history):
            saved = entry.get(state.DIGEST)
            if saved is None:  # saved by an earlier version
                continue
            p = Progress.from_json(entry)
            if digest.parse(saved) != self.fingerprint(epoch, history[:i], p):
                a, z = self.delivered(epoch, history[:i], p)
                raise ValueError(f"{_where(a, z, epoch)}: this state's segment {i} ({p.world_size} ranks x "
                                 f"{p.num_workers} workers, counts {list(p.yielded)}) is not the one its fingerprint "
                                 "was made from (an edited or mixed-up state): resuming from it would repeat or skip "
                                 "samples there")

    def check_worker(self, epoch: int, history: Sequence[dict[str, Any]], found: dict[str, Any]) -> None:
        """Refuse a worker state whose count is not that of the samples it delivered."""
        saved = found.get(state.DIGEST)
        if saved is None:
            return
        if not isinstance(saved, dict) or not isinstance(saved.get("rank"), int) or "sums" not in saved:
            raise ValueError(f"not a valid shardkit state ({state.DIGEST} must hold a rank and sums)")
        world, workers, w = int(found[state.WORLD_SIZE]), int(found[state.NUM_WORKERS]), int(found[state.WORKER])
        k = int(found[state.YIELDED])
        progress = Progress(world, workers, tuple(k if i == w else 0 for i in range(workers)),
                            int(found.get(state.BATCH, 1)))
        rank = saved["rank"]
        if not 0 <= rank < world or digest.parse(saved["sums"]) != self.fingerprint(epoch, history, progress, rank, w):
            full = self.worker_sizes(epoch, history, world, workers)
            a, z = self.delivered(epoch, history, Progress(world, workers, tuple(full), progress.batch), rank % world, w)
            raise ValueError(f"{_where(a, z, epoch)}: worker {w} of rank {rank} says it delivered {k} samples, not "
                             "the ones its fingerprint records (an edited or stale state): resuming from it would "
                             "repeat or skip samples there")

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


def _where(starts: np.ndarray, stops: np.ndarray, epoch: int) -> str:
    """Names the sample range that spans cover."""
    if not len(starts):
        return f"epoch {epoch}"
    return f"epoch {epoch}, positions {int(starts.min())}..{int(stops.max()) - 1}"


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
        saved = state.worker_state(self.epoch, self.world, self.num_workers, self.ordering.batch, self.worker_id,
                                   self.skip + self.yielded, self.ordering.key, self.history)
        saved[state.DIGEST] = {"rank": self.rank, "sums": digest.text(self._delivered())}
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
        if self.skip + self.yielded != sizes[self.worker_id] or \
                self._delivered() != o.fingerprint(self.epoch, self.history, full, self.rank, self.worker_id):
            a, z = o.delivered(self.epoch, self.history, full, self.rank, self.worker_id)
            raise RuntimeError(f"{_where(a, z, self.epoch)}: worker {self.worker_id} of rank {self.rank} delivered "
                               f"{self.skip + self.yielded} samples that are not its share of the epoch "
                               f"({sizes[self.worker_id]}): samples there were repeated or skipped")

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
        self.ordering.check_history(self.epoch, self.history)
        self.ordering.check_worker(self.epoch, self.history, found)
        self.skip = int(found[state.YIELDED])
        if state.DIGEST in found:
            self._done = digest.parse(found[state.DIGEST]["sums"])
        elif self.skip:  # an earlier version's state: what it delivered is taken as its count says
            self._done = self.ordering.fingerprint(self.epoch, self.history, Progress(
                self.world, self.num_workers, tuple(self.skip * (i == self.worker_id) for i in range(self.num_workers)),
                self.ordering.batch), self.rank, self.worker_id)
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
            for slots in globalbatch.worker_slots(gb, o.batches_before(self.history), self.world, self.rank,
                                                  self.num_workers, self.worker_id, self.skip):
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
