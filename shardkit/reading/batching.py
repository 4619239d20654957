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

Safety: a segment is reused only after every tensor the main process built on it, views
included, has been freed. Each tensor holds the numpy array it was made from; a finalizer on
those arrays clears the segment's busy byte when the last one goes. A consumer that keeps
batches keeps their segments busy, and the pool makes new ones (at most `MAX_SEGMENTS`, then
one-off segments that are never reused).

The batch has the structure and types that `default_collate` gives the same samples:
tensors and numpy arrays stacked, Python numbers as 1-D tensors, mappings and namedtuples
kept, tuples and lists as lists, anything else through `default_collate`.

One more thing keeps a worker's memory warm: glibc hands freed heap back to the kernel as
soon as 128 KB sit free at its top, and serves blocks over 128 KB with fresh maps, so every
decoded image faults its pages in again (~35 faults an image here once the batches no
longer hold the heap up). A worker that batches keeps its heap (`_keep_heap`): its resident
memory stays at its high-water mark instead of bouncing off it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from . import worker

HEADER = 64  # byte 0: the busy flag; bytes 8-16: the segment's token; data starts cache-line aligned
MAX_SEGMENTS = 16  # pooled segments per process (prefetch_factor up to ~14); past that, one-off segments
_NUMBERS = {bool: np.dtype(np.bool_), int: np.dtype(np.int64), float: np.dtype(np.float64)}
_PROC_FD = os.path.isdir("/proc/self/fd")  # Linux: another process can reopen our descriptors
_MAX_WRITE = 1 << 30  # bytes a pwrite: macOS refuses counts over INT_MAX (Linux writes at most ~2 GB a call)


class _Segment:
    """A block of shared memory that can be mapped by another process from its descriptor."""

    def __init__(self, size: int):
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("shardkit-batch", os.MFD_CLOEXEC)
        else:  # no memfd (macOS): an unlinked temporary file
            fd, path = tempfile.mkstemp(prefix="shardkit-batch-")
            os.unlink(path)
            self.fd = fd
        os.ftruncate(self.fd, size)
        self.size = size
        self.mm = mmap.mmap(self.fd, size)
        self.token = int.from_bytes(os.urandom(8), "little")  # names it in the main process's map cache
        self.mm[8:16] = self.token.to_bytes(8, "little")

    @property
    def busy(self) -> bool:
        return self.mm[0] != 0

    def write(self, offset: int, value: np.ndarray) -> None:
        """Copy `value` in at `offset` through the descriptor, not the mapping: this process
        never maps the data pages (only the header's), so a batch handed to the main process
        counts in that process's RSS alone, and a reused segment costs no page faults here."""
        data = memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)  # empty arrays too
        while data:
            written = os.pwrite(self.fd, data[:_MAX_WRITE], offset)
            data, offset = data[written:], offset + written

    def __del__(self) -> None:
        if hasattr(self, "fd"):
            os.close(self.fd)  # the mapping goes with the last array over it


class _Pool:
    """This process's segments; `acquire` marks the one it returns busy. A segment, reused or
    one-off, stays open until the main process has let go of it: it may still have to open
    it by descriptor."""

    def __init__(self) -> None:
        self.segments: list[_Segment] = []
        self.one_off: list[_Segment] = []
        self._lock = threading.Lock()

    def acquire(self, size: int) -> _Segment:
        with self._lock:  # two threads of one process (num_workers=0, thread pools) never share one
            return self._acquire(size)

    def _acquire(self, size: int) -> _Segment:
        self.one_off = [s for s in self.one_off if s.busy]
        free = [s for s in self.segments if not s.busy]
        fit = [s for s in free if s.size >= size]
        if fit:
            seg = min(fit, key=lambda s: s.size)
        else:
            seg = _Segment(size)
            if len(self.segments) < MAX_SEGMENTS:
                self.segments.append(seg)
            elif free:  # replace a free segment that is too small
                self.segments[self.segments.index(free[0])] = seg
            else:
                self.one_off.append(seg)
        seg.mm[0] = 1
        return seg


_pool: tuple[int, _Pool] | None = None
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def _keep_heap() -> None:
    """Ask glibc, if that is the allocator, to keep up to 64 MB of free heap and to serve
    blocks up to 32 MB (its maximum) from the heap. A no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    except (OSError, AttributeError):
        pass


def _process_pool() -> _Pool:
    """One pool per process (a forked child starts its own), kept across passes so that
    persistent workers reuse their segments epoch after epoch."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), _Pool())
        if get_worker_info() is not None:  # our worker process; the user's main process is theirs
            worker.settle()
            _keep_heap()
    return _pool[1]


# ------------------------------------------------------------------ structure of a sample

_Spec = Any  # int (a leaf) | ("dict", type, keys, specs) | ("named", type, specs) | ("list", specs)


def _flatten(item: Any, leaves: list[Any], like: _Spec = None) -> _Spec:
    """The structure of `item`, its leaves appended to `leaves`. With `like` (the batch's
    first sample), mappings are read in that sample's key order, as default_collate does."""
    if isinstance(item, Mapping):
        same = isinstance(like, tuple) and like[0] == "dict" and set(like[2]) == set(item)
        keys, subs = (like[2], like[3]) if same else (tuple(item), (None,) * len(item))
        return ("dict", type(item), keys, tuple(_flatten(item[k], leaves, sub) for k, sub in zip(keys, subs)))
    subs = like[-1] if isinstance(like, tuple) else None
    if isinstance(item, tuple) and hasattr(item, "_fields"):
        return ("named", type(item), tuple(_flatten(v, leaves, _sub(subs, i)) for i, v in enumerate(item)))
    if isinstance(item, (tuple, list)):
        return ("list", tuple(_flatten(v, leaves, _sub(subs, i)) for i, v in enumerate(item)))
    leaves.append(item)
    return len(leaves) - 1


def _leaves_of(spec: _Spec, path: str = "", in_sequence: bool = False) -> list[tuple[str, bool]]:
    """(path, in_sequence) of each leaf of `spec`, in leaf order: its place in the sample
    for messages (`['image']`, `[0]`), and whether it sits in a tuple or list, where
    default_collate batches values that it does not stack as a tuple (zip's), not a list."""
    if isinstance(spec, int):
        return [(path, in_sequence)]
    if spec[0] == "dict":
        return [leaf for k, sub in zip(spec[2], spec[3]) for leaf in _leaves_of(sub, f"{path}[{k!r}]")]
    return [leaf for i, sub in enumerate(spec[-1]) for leaf in _leaves_of(sub, f"{path}[{i}]", True)]


def _sub(subs: Any, i: int) -> _Spec:
    return subs[i] if isinstance(subs, tuple) and i < len(subs) else None


def _unflatten(spec: _Spec, leaves: list[Any]) -> Any:
    if isinstance(spec, int):
        return leaves[spec]
    if spec[0] == "dict":
        _, kind, keys, specs = spec
        out = {k: _unflatten(s, leaves) for k, s in zip(keys, specs)}
        try:
            return kind(out)
        except TypeError:
            return out
    if spec[0] == "named":
        return spec[1](*(_unflatten(s, leaves) for s in spec[2]))
    return [_unflatten(s, leaves) for s in spec[1]]


def _array_of(leaf: Any) -> np.ndarray | None:
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


class _Layout:
    """Where each leaf of a batch lives: ("array", offset, shape, dtype, number), a (batch,
    *shape) block of a segment, or ("other",) collated by default_collate. Made from a
    batch's first sample. `number`: the first sample's leaf was a Python number;
    default_collate decides the slot's dtype from all of its values (and takes 0-d tensors
    among them)."""

    def __init__(self, spec: _Spec, leaves: list[Any], batch: int):
        self.spec, self.batch = spec, batch
        self.places = _leaves_of(spec)
        self.slots: list[tuple[Any, ...]] = []
        offset = HEADER
        for leaf in leaves:
            arr = _array_of(leaf)
            number = arr is None and type(leaf) in _NUMBERS
            if number:
                arr = np.asarray(leaf, dtype=_NUMBERS[type(leaf)])
            if arr is None:
                self.slots.append(("other",))
                continue
            self.slots.append(("array", offset, arr.shape, arr.dtype, number))
            offset += -(-batch * arr.nbytes // 64) * 64
        self.size = offset


# ------------------------------------------------------------------ the worker side


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
        layout = _Layout(_flatten(item, leaves), leaves, self.batch_size)
        seg = _process_pool().acquire(layout.size)
        try:
            others: list[list[Any]] = [[] for _ in layout.slots]
            n = 0
            while True:
                if n:
                    leaves = []
                    if _flatten(item, leaves, layout.spec) != layout.spec:
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

    def _put(self, seg: _Segment, layout: _Layout, others: list[list[Any]], leaves: list[Any], n: int) -> None:
        """Copy sample `n`'s leaves into row n of the batch."""
        for j, (leaf, slot) in enumerate(zip(leaves, layout.slots)):
            if slot[0] == "other" or slot[4]:  # collated at the end of the batch
                others[j].append(leaf)
                continue
            _, offset, shape, dtype, _ = slot
            value = _array_of(leaf)
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


# ------------------------------------------------------------------ crossing to the main process


class SharedBatch:
    """A batch in a shared segment, on its way from a DataLoader worker to the main process.
    Pickling sends the segment's descriptor, not the data; unpickling gives the batch itself
    (tensors over the shared pages). Pass `batch_size=None` to the DataLoader: it must not
    collate these again."""

    def __init__(self, seg: _Segment, layout: _Layout, n: int, collated: list[Any]):
        self.seg, self.layout, self.n, self.collated = seg, layout, n, collated
        self.handle: Any = None

    def share(self) -> SharedBatch:
        """Say how the main process can open the segment. On Linux it reopens the worker's
        descriptor by its /proc path: no handshake. Elsewhere multiprocessing passes the
        descriptor over a socket (its DupFd), offered now from the worker's own thread:
        offered lazily from DataLoader's queue thread, the handshake fights the decoding for
        the GIL, and it delayed the first batch by ~100 ms here."""
        if _PROC_FD:
            self.handle = f"/proc/{os.getpid()}/fd/{self.seg.fd}"
        else:
            from multiprocessing.reduction import DupFd

            self.handle = DupFd(self.seg.fd)
        return self

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.handle is None:
            self.share()
        handle = self.handle
        if not isinstance(handle, str):
            self.handle = None  # a DupFd offer is taken once
        return _rebuild, (handle, self.seg.size, self.seg.token, self.layout, self.n, self.collated)

    def materialize(self) -> Any:
        """The batch in this process (no worker processes: the loader's own process)."""
        seg = self.seg
        return _materialize(np.frombuffer(seg.mm, np.uint8), (seg.token, seg.size), self.layout, self.n, self.collated)


def _collated_again(batch: list[SharedBatch], *, collate_fn_map: Any = None) -> Any:
    raise TypeError(
        "the dataset batches already (batch_size= on the dataset): give the DataLoader batch_size=None, "
        "or drop batch_size from the dataset and give the DataLoader collate_fn=shardkit.collate"
    )


# default_collate's table of types (torch's documented way to extend it): a DataLoader that
# batches what a batching dataset hands it says so, instead of failing on an unknown type
with contextlib.suppress(ImportError):
    from torch.utils.data._utils.collate import default_collate_fn_map

    default_collate_fn_map[SharedBatch] = _collated_again


def _rebuild(handle: Any, size: int, token: int, layout: _Layout, n: int, collated: list[Any]) -> Any:
    key = (token, size)
    fd = None if isinstance(handle, str) else handle.detach()  # a DupFd offer is always taken
    live = _Release.live.get(key)  # mapped again only after every array of the last mapping was freed
    if live is not None:
        if fd is not None:
            os.close(fd)
        return _materialize(live.base, key, layout, n, collated)
    if fd is None:  # the worker's /proc path (the worker keeps it open for us)
        try:
            fd = os.open(handle, os.O_RDWR)
        except OSError as e:
            raise RuntimeError(f"cannot open a DataLoader worker's batch buffer {handle}: {e}") from e
    return _materialize(_map(fd, size, token), key, layout, n, collated)


def _map(fd: int, size: int, token: int) -> np.ndarray:
    try:
        base = np.frombuffer(mmap.mmap(fd, size), np.uint8)
    finally:
        os.close(fd)
    if int.from_bytes(base[8:16].tobytes(), "little") != token:
        raise RuntimeError("a DataLoader worker's batch buffer is not the one the batch names")
    return base


class _Release:
    """Clears a segment's busy byte when the last array over it is freed, whichever batch
    (or second unpickling of one) it belongs to, and from any thread: the training loop and
    DataLoader's pin-memory thread both drop tensors. Re-entrant: a garbage collection inside
    the lock may run another of these finalizers."""

    lock = threading.RLock()
    live: dict[tuple[int, int], _Release] = {}  # segment -> its release and mapping, while arrays are alive

    def __init__(self, key: tuple[int, int], base: np.ndarray):
        self.key, self.base, self.count = key, base, 0

    @classmethod
    def hold(cls, key: tuple[int, int], base: np.ndarray, arrays: int) -> _Release:
        with cls.lock:
            release = cls.live.get(key)
            if release is None:
                release = cls.live[key] = _Release(key, base)
            release.count += arrays
            if release.count == 0:
                release.free()
            return release

    def free(self) -> None:
        self.base[0] = 0
        _Release.live.pop(self.key, None)

    def __call__(self) -> None:
        with _Release.lock:
            self.count -= 1
            if self.count == 0:
                self.free()


def _materialize(base: np.ndarray, key: tuple[int, int], layout: _Layout, n: int, collated: list[Any]) -> Any:
    arrays = [s for s in layout.slots if s[0] == "array"]
    release = _Release.hold(key, base, len(arrays))
    base = release.base  # the mapping already live for this segment, if there is one
    leaves: list[Any] = []
    for slot, other in zip(layout.slots, collated):
        if slot[0] == "other":
            leaves.append(other)
            continue
        _, offset, shape, dtype, _ = slot
        count = n * int(np.prod(shape))
        arr = base[offset : offset + count * dtype.itemsize].view(dtype).reshape(n, *shape)
        weakref.finalize(arr, release)  # the tensor holds `arr`; so do its views, via the storage
        leaves.append(torch.from_numpy(arr))
    return _unflatten(layout.spec, leaves)
