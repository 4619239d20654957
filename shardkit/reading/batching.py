"""Batches built in the DataLoader worker, in shared memory that is reused only once the
main process has let go of it: `StreamingDataset(..., batch_size=B)` with
`DataLoader(ds, batch_size=None)`, or `collate` as any DataLoader's `collate_fn` (map-style
datasets such as LMDBDataset included).

Why: with `DataLoader(batch_size=B)` a worker holds B sample tensors, then default_collate
copies them into a fresh shared-memory segment. The kernel zero-fills every page of that
segment, and the worker's heap shrinks and regrows around the freed samples: here that was
~60 page faults and ~12% more CPU per image than the same decoding in a bare process. Here
each sample is copied into its row of the batch as soon as the transform returns it (its
tensor is freed at once, so the heap stays warm), into a segment from a small per-process
pool. The worker writes the rows with `pwrite` on the segment's descriptor and never maps
them: the batches it has handed over (queued, or in the main process's hands) are resident
in the main process only, not once more in the worker's RSS, and reusing a segment costs
the worker no page faults.

Where the memory comes from is segments.py, a batch's structure batch_layout.py, its crossing
to the main process shared_batch.py.

The batch has the structure and types that `default_collate` gives the same samples:
tensors and numpy arrays stacked, Python numbers as 1-D tensors, mappings and namedtuples
kept, tuples and lists as lists, anything else through `default_collate`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import default_collate, get_worker_info

from .batch_layout import Layout, array_of, flatten
from .segments import Segment, process_pool
from .shared_batch import SharedBatch


def collate(samples: list[Any]) -> Any:
    """A drop-in for `default_collate` (`DataLoader(ds, batch_size=B, collate_fn=shardkit.collate)`)
    that stacks into reused shared memory instead of a fresh segment per batch. In a worker it
    returns a `SharedBatch` that becomes the batch in the main process: pass it as the
    DataLoader's `collate_fn` itself, not inside another collate function.

    Args:
        samples: the samples of one batch, of equal shapes and dtypes where they are stacked.
    """
    if not isinstance(samples, (list, tuple)):  # a DataLoader with batch_size=None hands it one sample
        raise TypeError(
            f"collate takes a list of samples, not {type(samples).__name__}: give the DataLoader a "
            "batch_size (with batch_size=None it passes collate_fn one sample at a time)"
        )
    samples = list(samples)
    if not samples:
        raise ValueError("collate needs at least one sample")
    return next(Batches(iter(samples), len(samples)))


class Batches:
    """Batches of `batch_size` samples of one worker's stream; the last may be shorter.

    Stateful like the stream it wraps (torchdata's protocol): a state taken between batches
    counts whole batches' samples, so a resume starts at a batch boundary.
    """

    def __init__(self, stream: Any, batch_size: int):
        self.stream, self.batch_size = stream, batch_size
        self._in_worker = get_worker_info() is not None

    def __iter__(self) -> Batches:
        return self

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.stream.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)

    def __del__(self) -> None:
        close = getattr(self.stream, "close", None)  # a pass (see epochs.Samples), not collate's list
        if close is not None:
            close()

    def __next__(self) -> Any:
        item = next(self.stream)  # StopIteration ends the batches too
        leaves: list[Any] = []
        layout = Layout(flatten(item, leaves), leaves, self.batch_size)
        seg = process_pool().acquire(layout.size)
        try:
            others: list[list[Any]] = [[] for _ in layout.slots]
            n = 0
            while True:
                if n:
                    leaves = []
                    if flatten(item, leaves, layout.spec) != layout.spec:
                        raise ValueError(
                            f"batch_size={self.batch_size}: sample {n} of a batch has another "
                            "structure than the first (all samples of a batch must match)"
                        )
                item = None  # free the sample as soon as it is copied: the next one reuses its memory
                self._put(seg, layout, others, leaves, n)
                leaves = []
                n += 1
                if n == self.batch_size:
                    break
                try:
                    item = next(self.stream)
                except StopIteration:
                    break
            collated: list[Any] = []
            for j, (values, slot) in enumerate(zip(others, layout.slots)):
                if not values:
                    collated.append(None)
                    continue
                batch = default_collate(tuple(values) if layout.places[j][1] else values)  # type: ignore[arg-type]  # torch's hint says list; any sequence works
                if slot[0] == "array" and isinstance(batch, torch.Tensor) and batch.numpy().dtype == slot[3]:
                    seg.write(slot[1], batch.numpy())
                    collated.append(None)
                else:  # a number slot whose dtype the later samples changed: sent as it is
                    layout.slots[j] = ("other",)
                    collated.append(batch)
        except BaseException:
            seg.mm[0] = 0
            raise
        batch = SharedBatch(seg, layout, n, collated)
        return batch.share() if self._in_worker else batch.materialize()

    def _put(self, seg: Segment, layout: Layout, others: list[list[Any]], leaves: list[Any], n: int) -> None:
        """Copy sample `n`'s leaves into row n of the batch."""
        for j, (leaf, slot) in enumerate(zip(leaves, layout.slots)):
            if slot[0] == "other" or slot[4]:  # collated at the end of the batch
                others[j].append(leaf)
                continue
            _, offset, shape, dtype, _ = slot
            value = array_of(leaf)
            if value is None or value.shape != shape or value.dtype != dtype:
                field = f"field {layout.places[j][0]}" if layout.places[j][0] else "the sample"
                raise ValueError(
                    f"batch_size={self.batch_size}: cannot stack sample {n} of a batch: {field} is "
                    f"{_describe(leaf)}, in the batch's first sample it is {dtype} of shape {tuple(shape)}"
                )
            seg.write(offset + n * value.nbytes, value)


def _describe(leaf: Any) -> str:
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    grad = " that requires grad" if getattr(leaf, "requires_grad", False) else ""
    return f"{dtype} of shape {tuple(shape)}{grad}" if shape is not None else type(leaf).__name__
