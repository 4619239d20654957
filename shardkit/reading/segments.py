"""The shared memory that batches are built in: segments a DataLoader worker writes with
`pwrite` on their descriptor (never mapping the data pages), and one pool of them a process,
reused once the main process has let go of a segment (see batching.py for why).

Safety: a segment is reused only after every tensor the main process built on it, views
included, has been freed. Each tensor holds the numpy array it was made from; a finalizer
on those arrays (shared_batch.py) clears the segment's busy byte when the last one goes. A
consumer that keeps batches keeps their segments busy, and the pool makes new ones (at most
`MAX_SEGMENTS`, then one-off segments that are never reused).

One more thing keeps a worker's memory warm: glibc hands freed heap back to the kernel as
soon as 128 KB sit free at its top, and serves blocks over 128 KB with fresh maps, so every
decoded image faults its pages in again (~35 faults an image here once the batches no
longer hold the heap up). A worker that batches keeps its heap (`_keep_heap`): its resident
memory stays at its high-water mark instead of bouncing off it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import threading

import numpy as np
from torch.utils.data import get_worker_info

from . import worker

HEADER = 64  # byte 0: the busy flag; bytes 8-16: the segment's token; data starts cache-line aligned
MAX_SEGMENTS = 16  # pooled segments per process (prefetch_factor up to ~14); past that, one-off segments
_MAX_WRITE = 1 << 30  # bytes a pwrite: macOS refuses counts over INT_MAX (Linux writes at most ~2 GB a call)


class Segment:
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


class Pool:
    """This process's segments; `acquire` marks the one it returns busy. A segment, reused or
    one-off, stays open until the main process has let go of it: it may still have to open
    it by descriptor."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []
        self.one_off: list[Segment] = []
        self._lock = threading.Lock()

    def acquire(self, size: int) -> Segment:
        with self._lock:  # two threads of one process (num_workers=0, thread pools) never share one
            return self._acquire(size)

    def _acquire(self, size: int) -> Segment:
        self.one_off = [s for s in self.one_off if s.busy]
        free = [s for s in self.segments if not s.busy]
        fit = [s for s in free if s.size >= size]
        if fit:
            seg = min(fit, key=lambda s: s.size)
        else:
            seg = Segment(size)
            if len(self.segments) < MAX_SEGMENTS:
                self.segments.append(seg)
            elif free:  # replace a free segment that is too small
                self.segments[self.segments.index(free[0])] = seg
            else:
                self.one_off.append(seg)
        seg.mm[0] = 1
        return seg


_pool: tuple[int, Pool] | None = None
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


def process_pool() -> Pool:
    """One pool per process (a forked child starts its own), kept across passes so that
    persistent workers reuse their segments epoch after epoch."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        _pool = (os.getpid(), Pool())
        if get_worker_info() is not None:  # our worker process; the user's main process is theirs
            worker.settle()
            _keep_heap()
    return _pool[1]
