"""An epoch's order, as a pass sees it: what the sequence and its split over ranks and
workers depend on (`Ordering`), in either order (the default, order/partition.py; global
batches, order/globalbatch.py), and the fingerprints of what was delivered (order/digest.py): worked
out from a state's counts, and checked against those a state carries, so that a resume
that would repeat or skip samples fails naming them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..order import digest, globalbatch, partition
from ..order.partition import Layout
from ..order.progress import Progress, Segments, wrapped
from ..order.progress import delivered as delivered_spans
from . import state


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
        return globalbatch.plan(
            self.total,
            self.global_batch,
            remainder=self.remainder,
            shuffle=self.shuffle,
            window=self.shuffle_window,
            piece=self.piece,
            seed=self.seed,
            epoch=epoch,
            bounds=bounds,
        )

    def batches_before(self, history: Sequence[dict[str, Any]]) -> int:
        """Global batches that the interrupted segments in `history` delivered."""
        done = 0
        for entry in history:
            p = Progress.from_json(entry)
            done += globalbatch.batches_done(
                p.num_workers, p.yielded, globalbatch.local_size(self.global_batch, p.world_size)
            )
        return done

    def per_rank(self, epoch: int, history: Sequence[dict[str, Any]], world: int) -> int:
        """Samples each rank yields in a pass that follows `history`."""
        if self.global_batch:
            gb = self.global_batches(epoch)
            return (gb.batches - self.batches_before(history)) * globalbatch.local_size(self.global_batch, world)
        return partition.per_rank(self.left(epoch, history).left, world, self.remainder)

    def fingerprint(
        self,
        epoch: int,
        history: Sequence[dict[str, Any]],
        progress: Progress,
        rank: int | None = None,
        worker_id: int | None = None,
    ) -> digest.Digest:
        """The fingerprint of what `progress` delivered after `history` (of one rank, or one
        worker, if given): epoch positions, or slots of the global batches."""
        a, z = self.delivered(epoch, history, progress, rank, worker_id)
        return digest.of_spans(a, z)

    def delivered(
        self,
        epoch: int,
        history: Sequence[dict[str, Any]],
        progress: Progress,
        rank: int | None = None,
        worker_id: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
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
        a, z = wrapped(*delivered_spans(left.left, layout, progress, rank, worker_id), left.left)
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
                raise ValueError(
                    f"{where(a, z, epoch)}: this state's segment {i} ({p.world_size} ranks x "
                    f"{p.num_workers} workers, counts {list(p.yielded)}) is not the one its fingerprint "
                    "was made from (an edited or mixed-up state): resuming from it would repeat or skip "
                    "samples there"
                )

    def check_worker(self, epoch: int, history: Sequence[dict[str, Any]], found: dict[str, Any]) -> None:
        """Refuse a worker state whose count is not that of the samples it delivered."""
        saved = found.get(state.DIGEST)
        if saved is None:
            return
        if not isinstance(saved, dict) or not isinstance(saved.get(state.RANK), int) or state.SUMS not in saved:
            raise ValueError(f"not a valid shardkit state ({state.DIGEST} must hold a rank and sums)")
        world, workers, w = int(found[state.WORLD_SIZE]), int(found[state.NUM_WORKERS]), int(found[state.WORKER])
        k = int(found[state.YIELDED])
        progress = Progress(
            world, workers, tuple(k if i == w else 0 for i in range(workers)), int(found.get(state.BATCH, 1))
        )
        rank = saved[state.RANK]
        if not 0 <= rank < world or digest.parse(saved[state.SUMS]) != self.fingerprint(
            epoch, history, progress, rank, w
        ):
            full = self.worker_sizes(epoch, history, world, workers)
            a, z = self.delivered(
                epoch, history, Progress(world, workers, tuple(full), progress.batch), rank % world, w
            )
            raise ValueError(
                f"{where(a, z, epoch)}: worker {w} of rank {rank} says it delivered {k} samples, not "
                "the ones its fingerprint records (an edited or stale state): resuming from it would "
                "repeat or skip samples there"
            )

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
        return Layout(
            world, workers, self.seed, epoch, self.shuffle, self.shuffle_window, self.remainder, segment, batch
        )

    def left(self, epoch: int, history: Sequence[dict[str, Any]]) -> Segments:
        """The epoch's sequence minus what the interrupted segments in `history` delivered."""
        left = Segments(self.total)
        for segment, done in enumerate(history):
            p = Progress.from_json(done)
            left = left.after(self.segment(epoch, p.world_size, p.num_workers, segment, p.batch), p)
        return left


def where(starts: np.ndarray, stops: np.ndarray, epoch: int) -> str:
    """Names the sample range that spans cover."""
    if not len(starts):
        return f"epoch {epoch}"
    return f"epoch {epoch}, positions {int(starts.min())}..{int(stops.max()) - 1}"
