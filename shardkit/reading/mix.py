"""Several datasets drawn by weight into one stream, with StreamingDataset's guarantees.

An epoch of the mixture has `samples_per_epoch` positions (default: all parts' samples
together); dataset d fills counts[d] of them, proportional to its weight. Each part walks
its own endless sequence of epochs (its own shuffle of epoch k for k = 0, 1, ...): mixture
epoch e takes its samples e*counts[d] .. (e+1)*counts[d] - 1 of that sequence. So a part
weighted above its size repeats (it runs through several of its own epochs in one mixture
epoch), one weighted below is spread over several mixture epochs, and within each of its
own epochs every sample comes once (a mixture epoch that holds the end of one of them and
the start of the next can hold a sample twice). The positions themselves are split across ranks and
workers exactly as a StreamingDataset's samples are: equal counts per rank, reproducible
from (seed, epoch), elastic resume.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from .. import checks
from ..order import partition, ranges
from . import state
from .counters import Slot
from .epoch_stream import EpochStream
from .epochs import EpochDataset, distinct, stats_summary
from .pass_ import Pass
from ..storage.fetch import per_worker
from .sources.base import SampleSource
from .spec import ReadSpec


class Part(Protocol):
    """What a mixture asks of each of its datasets (a StreamingDataset)."""

    shuffle: bool
    shuffle_window: int

    @property
    def source(self) -> SampleSource: ...

    def total_samples(self) -> int: ...

    def order_key(self) -> dict[str, Any]: ...

    def read_spec(self) -> ReadSpec: ...

    def slot(self, worker_id: int) -> Slot: ...

    def stats(self) -> dict[str, Any]: ...

    def store_name(self) -> str: ...

    def store_config(self) -> list[dict[str, str]]: ...


def check_parts(parts: Any) -> None:
    """A mix's parts are a non-empty list of (dataset, weight) pairs."""
    if not isinstance(parts, Sequence) or not parts:
        raise ValueError("mix needs a list of (dataset, weight) pairs, at least one")
    for part in parts:
        if not (isinstance(part, (tuple, list)) and len(part) == 2):
            raise TypeError(f"each part of a mix is a (dataset, weight) pair, not {part!r}")


def _weight(w: Any) -> float:
    try:
        if isinstance(w, (str, bytes, bool)):
            raise TypeError
        value = float(w)  # numpy and torch scalars, Decimal, Fraction
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value < float("inf"):
        raise ValueError(f"a mix weight is a positive finite number, not {w!r}")
    return value


class MixedDataset(EpochDataset):
    """Build it with `StreamingDataset.mix([(source, weight), ...], ...)`, which makes the
    parts given as URLs."""

    OPTIONS = (
        "samples_per_epoch",
        "shuffle_window",
        "remainder",
        "batch_size",
        "global_batch_size",
    )  # the mixture's own, besides its order

    def __init__(
        self,
        parts: Sequence[tuple[Part, Any]],
        *,
        samples_per_epoch: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_window: int = 1024,
        remainder: str = "repeat",
        rank: int | None = None,
        world_size: int | None = None,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
    ):
        super().__init__(
            rank,
            world_size,
            shuffle=shuffle,
            seed=seed,
            shuffle_window=shuffle_window,
            remainder=remainder,
            batch_size=batch_size,
            global_batch_size=global_batch_size,
        )
        check_parts(parts)
        self.parts = [p for p, _ in parts]
        self.weights = tuple(_weight(w) for _, w in parts)
        self.sizes = tuple(p.total_samples() for p in self.parts)
        if 0 in self.sizes:
            raise ValueError("every dataset of a mix needs at least one sample")
        self.samples_per_epoch = (
            checks.integer("samples_per_epoch", samples_per_epoch, 1)
            if samples_per_epoch is not None
            else sum(self.sizes)
        )
        self.counts = partition.mix_counts(self.weights, self.samples_per_epoch)
        if not self.counts.all():
            d = int(np.argmin(self.counts))
            raise ValueError(
                f"part {d} (weight {self.weights[d]:g}) gets no sample in an epoch of {self.samples_per_epoch}: "
                "raise its weight or samples_per_epoch, or leave it out"
            )

    def total_samples(self) -> int:
        return self.samples_per_epoch

    def order_key(self) -> dict[str, Any]:
        parts = [
            {k: v for k, v in p.order_key().items() if k in ("shuffle", "seed", "block", "shard_sizes")}
            for p in self.parts
        ]
        order = {
            **super().order_key(),
            "counts": [int(c) for c in self.counts],
            "sizes": list(self.sizes),
            "parts": parts,
        }  # what orders each part's own epochs
        if any(p.shuffle for p in self.parts):
            order[state.SHUFFLE_VERSION_KEY] = state.SHUFFLE_VERSION
        return order

    def __iter__(self) -> Iterator[Any]:
        return self._stream(self._pass(*self._layout()))

    def _pass(self, rank: int, world: int, worker_id: int, num_workers: int) -> EpochStream:
        inputs = [
            (
                dataclasses.replace(p.read_spec(), global_batches=bool(self.global_batch_size)),
                p.source,
                p.slot(worker_id),
            )
            for p in self.parts
        ]
        connections = per_worker(num_workers) // len(self.parts) or 1  # the parts' passes share the worker's
        window = max(self.shuffle_window, *(p.shuffle_window for p in self.parts))
        counts, sizes, seed, shuffle = self.counts, self.sizes, self.seed, self.shuffle

        def run(epoch: int, positions: Iterator[np.ndarray]) -> Generator[Any, None, None]:
            specs = [spec for spec, _, _ in inputs]
            pieces = _Pieces(lambda p: _part_ids(counts, sizes, specs, seed, shuffle, epoch, p), positions)
            passes = [
                Pass(spec, source, pieces.of(d), slot, window, connections).samples()
                for d, (spec, source, slot) in enumerate(inputs)
            ]
            try:
                for part_of in pieces.of(-1):
                    for (d,) in ranges.rows(part_of):
                        yield next(passes[d])
            finally:
                for p in passes:
                    p.close()

        return self._epoch_stream(rank, world, worker_id, num_workers, run)

    def stats(self) -> dict[str, Any]:
        """The parts' statistics, summed."""
        totals = [p.stats() for p in self.parts]
        out = {k: sum(t[k] for t in totals) for k in totals[0] if k not in ("read_fraction", "store", "store_config")}
        return {**stats_summary(out), "store": self.store_name(), "store_config": self.store_config()}

    def store_name(self) -> str:
        return ", ".join(sorted({p.store_name() for p in self.parts}))

    def store_config(self) -> list[dict[str, str]]:
        return distinct(c for p in self.parts for c in p.store_config())


class _Pieces:
    """A mixed pass's pieces of positions, each turned once into (part of each position,
    each part's sample ids): the mixture's loop (`of(-1)`) and each part's pass (`of(d)`)
    walk them in step, a part's pass never past the piece the loop is in, so only the last
    few are kept."""

    KEEP = 4

    def __init__(
        self, plan: Callable[[np.ndarray], tuple[np.ndarray, list[np.ndarray]]], positions: Iterator[np.ndarray]
    ):
        self.plan, self.positions = plan, positions
        self.made: dict[int, tuple[np.ndarray, list[np.ndarray]]] = {}
        self.count = 0  # pieces made so far

    def _get(self, i: int) -> tuple[np.ndarray, list[np.ndarray]] | None:
        while self.count <= i:
            piece = next(self.positions, None)
            if piece is None:
                return None
            self.made[self.count] = self.plan(piece)
            self.made.pop(self.count - self.KEEP, None)
            self.count += 1
        return self.made.get(i)

    def of(self, d: int) -> Iterator[np.ndarray]:
        """Part d's ids piece by piece (-1: the part of each position). A piece no longer
        kept held none of part d's: its pass would have asked for it while it was."""
        for i in itertools.count():
            got = self._get(i)
            if got is None and i >= self.count:
                return
            yield np.empty(0, dtype=np.int64) if got is None else got[0] if d < 0 else got[1][d]


def _part_ids(
    counts: np.ndarray,
    sizes: Sequence[int],
    specs: Sequence[ReadSpec],
    seed: int,
    shuffle: bool,
    epoch: int,
    positions: np.ndarray,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(part of each position, each part's sample ids in the order of `positions`): the
    j-th draw of part d in mixture epoch e is its (e * counts[d] + j)-th sample overall."""
    order = partition.mix_order(counts, seed=seed, epoch=epoch, shuffle=shuffle)
    part_of, draw = order.draws(positions)
    by_part = np.argsort(part_of, kind="stable")  # each part's positions, in order
    bounds = np.searchsorted(part_of[by_part], np.arange(len(specs) + 1))
    ids = []
    for d, spec in enumerate(specs):
        steps = epoch * int(counts[d]) + draw[by_part[bounds[d] : bounds[d + 1]]]
        own_epoch, offset = np.divmod(steps, sizes[d])
        out = np.empty(len(steps), dtype=np.int64)
        by_epoch = np.argsort(own_epoch, kind="stable")  # each of the part's own epochs once
        epochs, starts = np.unique(own_epoch[by_epoch], return_index=True)
        for k, sel in zip(epochs.tolist(), np.split(by_epoch, starts[1:])):
            out[sel] = spec.order.ids_at(k, offset[sel])
        ids.append(out)
    return part_of, ids
