"""The structure of a batch: a sample flattened into leaves (mappings, namedtuples, tuples
and lists kept, as default_collate keeps them) and the place of each leaf in the batch's
segment (`Layout`), made from the batch's first sample."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .segments import HEADER

_NUMBERS = {bool: np.dtype(np.bool_), int: np.dtype(np.int64), float: np.dtype(np.float64)}


_Spec = Any  # int (a leaf) | ("dict", type, keys, specs) | ("named", type, specs) | ("list", specs)


def flatten(item: Any, leaves: list[Any], like: _Spec = None) -> _Spec:
    """The structure of `item`, its leaves appended to `leaves`. With `like` (the batch's
    first sample), mappings are read in that sample's key order, as default_collate does."""
    if isinstance(item, Mapping):
        same = isinstance(like, tuple) and like[0] == "dict" and set(like[2]) == set(item)
        keys, subs = (like[2], like[3]) if same else (tuple(item), (None,) * len(item))
        return ("dict", type(item), keys, tuple(flatten(item[k], leaves, sub) for k, sub in zip(keys, subs)))
    subs = like[-1] if isinstance(like, tuple) else None
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return ("named", type(item), tuple(flatten(v, leaves, _sub(subs, i)) for i, v in enumerate(item)))
    if isinstance(item, (tuple, list)):
        return ("list", tuple(flatten(v, leaves, _sub(subs, i)) for i, v in enumerate(item)))
    leaves.append(item)
    return len(leaves) - 1


def leaves_of(spec: _Spec, path: str = "", in_sequence: bool = False) -> list[tuple[str, bool]]:
    """(path, in_sequence) of each leaf of `spec`, in leaf order: its place in the sample
    for messages (`['image']`, `[0]`), and whether it sits in a tuple or list, where
    default_collate batches values that it does not stack as a tuple (zip's), not a list."""
    if isinstance(spec, int):
        return [(path, in_sequence)]
    if spec[0] == "dict":
        return [leaf for k, sub in zip(spec[2], spec[3]) for leaf in leaves_of(sub, f"{path}[{k!r}]")]
    return [leaf for i, sub in enumerate(spec[-1]) for leaf in leaves_of(sub, f"{path}[{i}]", True)]


def _sub(subs: Any, i: int) -> _Spec:
    return subs[i] if isinstance(subs, tuple) and i < len(subs) else None


def unflatten(spec: _Spec, leaves: list[Any]) -> Any:
    if isinstance(spec, int):
        return leaves[spec]
    if spec[0] == "dict":
        _, kind, keys, specs = spec
        out = {k: unflatten(s, leaves) for k, s in zip(keys, specs)}
        try:
            return kind(out)
        except TypeError:
            return out
    if spec[0] == "named":
        return spec[1](*(unflatten(s, leaves) for s in spec[2]))
    return [unflatten(s, leaves) for s in spec[1]]


def array_of(leaf: Any) -> np.ndarray | None:
    """The leaf as a numpy array if it can be stacked in shared memory, else None."""
    if isinstance(leaf, torch.Tensor):
        if leaf.device.type != "cpu" or leaf.requires_grad or leaf.is_sparse:
            return None
        try:
            return leaf.resolve_conj().resolve_neg().numpy()  # a lazy conj()/neg view: its values
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16, ...)
            return None
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "biufc":
        return leaf
    return None


class Layout:
    """Where each leaf of a batch lives: ("array", offset, shape, dtype, number), a (batch,
    *shape) block of a segment, or ("other",) collated by default_collate. Made from a
    batch's first sample. `number`: the first sample's leaf was a Python number;
    default_collate decides the slot's dtype from all of its values (and takes 0-d tensors
    among them)."""

    def __init__(self, spec: _Spec, leaves: list[Any], batch: int):
        self.spec, self.batch = spec, batch
        self.places = leaves_of(spec)
        self.slots: list[tuple[Any, ...]] = []
        offset = HEADER
        for leaf in leaves:
            arr = array_of(leaf)
            number = arr is None and type(leaf) in _NUMBERS
            if number:
                arr = np.asarray(leaf, dtype=_NUMBERS[type(leaf)])
            if arr is None:
                self.slots.append(("other",))
                continue
            self.slots.append(("array", offset, arr.shape, arr.dtype, number))
            offset += -(-batch * arr.nbytes // 64) * 64
        self.size = offset
