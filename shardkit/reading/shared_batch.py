"""A batch crossing from a DataLoader worker to the main process: pickled as its segment's
descriptor (the data stays in shared memory), unpickled as tensors over the shared pages,
and each segment freed for reuse when the last array over it goes (`_Release`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import weakref
from typing import Any

import numpy as np
import torch

from .batch_layout import Layout, unflatten
from .segments import Segment

_PROC_FD = os.path.isdir("/proc/self/fd")  # Linux: another process can reopen our descriptors


class SharedBatch:
    """A batch in a shared segment, on its way from a DataLoader worker to the main process.
    Pickling sends the segment's descriptor, not the data; unpickling gives the batch itself
    (tensors over the shared pages). Pass `batch_size=None` to the DataLoader: it must not
    collate these again."""

    def __init__(self, seg: Segment, layout: Layout, n: int, collated: list[Any]):
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


def _rebuild(handle: Any, size: int, token: int, layout: Layout, n: int, collated: list[Any]) -> Any:
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


def _materialize(base: np.ndarray, key: tuple[int, int], layout: Layout, n: int, collated: list[Any]) -> Any:
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
    return unflatten(layout.spec, leaves)
