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

from collections.abc import Generator, Iterator, Sequence
from typing import Any

import numpy as np

from .. import checks, partition, ranges
from .stream import WorkerStream
from .epochs import EpochDataset, EpochStream, stats_summary


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
    """Build it with `StreamingDataset.mix([(source, weight), ...], ...)`, which passes itself
    as `part_type`: the type of the parts, and what makes a part from a URL."""

    def __init__(self, parts: Sequence[tuple[Any, float]], *, part_type: type[Any],
                 samples_per_epoch: int | None = None, shuffle: bool = True, seed: int = 0,
                 shuffle_window: int = 1024, remainder: str = "repeat", rank: int | None = None,
                 world_size: int | None = None, batch_size: int | None = None, **options: Any):
        super().__init__(rank, world_size, shuffle=shuffle, seed=seed, shuffle_window=shuffle_window,
                         remainder=remainder, batch_size=batch_size)
        if not isinstance(parts, Sequence) or not parts:
            raise ValueError("mix needs a list of (dataset, weight) pairs, at least one")
        for part in parts:
            if not (isinstance(part, (tuple, list)) and len(part) == 2):
                raise TypeError(f"each part of a mix is a (dataset, weight) pair, not {part!r}")
        if any(isinstance(p, part_type) and p.batch_size for p, _ in parts):
            raise ValueError("the datasets of a mix yield samples: give batch_size to the mix, not to its parts")
        if options and any(isinstance(p, part_type) for p, _ in parts):
            raise ValueError(f"options for the parts ({', '.join(sorted(options))}) apply to parts given as URLs: "
                             "give them to the StreamingDataset parts themselves")
        self.parts = [
            p if isinstance(p, part_type)
            else part_type(p, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, **options)
            for p, _ in parts
        ]
        self.weights = tuple(_weight(w) for _, w in parts)
        self.sizes = tuple(p.total_samples() for p in self.parts)
        if 0 in self.sizes:
            raise ValueError("every dataset of a mix needs at least one sample")
        self.samples_per_epoch = (checks.integer("samples_per_epoch", samples_per_epoch, 1)
                                  if samples_per_epoch is not None else sum(self.sizes))
        self.counts = partition.mix_counts(self.weights, self.samples_per_epoch)
        if not self.counts.all():
            d = int(np.argmin(self.counts))
            raise ValueError(f"part {d} (weight {self.weights[d]:g}) gets no sample in an epoch of {self.samples_per_epoch}: "
                             "raise its weight or samples_per_epoch, or leave it out")

    def total_samples(self) -> int:
        return self.samples_per_epoch

    def _order(self) -> dict[str, Any]:
        parts = [{k: v for k, v in p._order().items() if k in ("shuffle", "seed", "block", "shard_sizes")} for p in self.parts]
        return {**super()._order(), "counts": [int(c) for c in self.counts], "sizes": list(self.sizes),
                "parts": parts}  # what orders each part's own epochs

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.arange(self.samples_per_epoch, dtype=np.int64)  # positions; _part_ids maps them to samples

    def __iter__(self) -> Iterator[Any]:
        return self._stream(_MixedStream(self, *self._layout()))

    def stats(self) -> dict[str, float]:
        """The parts' statistics, summed."""
        totals = [p._shared.totals() for p in self.parts]
        out = {k: sum(t[k] for t in totals) for k in totals[0]}
        return stats_summary(out)


class _MixedStream(EpochStream):
    ds: MixedDataset

    def _part_ids(self, positions: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """(part of each position, each part's sample ids in the order of `positions`)."""
        ds = self.ds
        sources = partition.mix_sources(ds.counts, seed=ds.seed, epoch=self.epoch, shuffle=ds.shuffle)
        # the j-th draw of part d in this epoch is its (epoch * counts[d] + j)-th sample overall
        draw = np.empty(len(sources), dtype=np.int64)
        for d in range(len(ds.parts)):
            mine = sources == d
            draw[mine] = self.epoch * ds.counts[d] + np.arange(int(mine.sum()))
        part_of = sources[positions]
        ids = []
        for d, part in enumerate(ds.parts):
            steps = draw[positions[part_of == d]]
            own_epoch, offset = steps // ds.sizes[d], steps % ds.sizes[d]
            out = np.empty(len(steps), dtype=np.int64)
            by_epoch = np.argsort(own_epoch, kind="stable")  # each of the part's own epochs once, not a scan per epoch
            epochs, starts = np.unique(own_epoch[by_epoch], return_index=True)
            for k, sel in zip(epochs.tolist(), np.split(by_epoch, starts[1:])):
                order = part.epoch_order(k)
                out[sel] = order[offset[sel]]
            ids.append(out)
        return part_of, ids

    def _generate(self) -> Generator[Any, None, None]:
        part_of, ids = self._part_ids(self._plan())
        window = max(self.ds.shuffle_window, *(p.shuffle_window for p in self.ds.parts))
        streams = [WorkerStream(p, self.rank, self.world, self.worker_id, self.num_workers, ids=i, window=window)
                   for p, i in zip(self.ds.parts, ids)]
        try:
            for (d,) in ranges.rows(part_of):
                yield next(streams[d])
        finally:
            for s in streams:
                s.close()
