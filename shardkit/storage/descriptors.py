"""The process's open local shard files, a bounded number at a time.

A pass over a shuffled epoch touches every shard, and a worker that kept each file open
until the pass ended ran out of descriptors past ~1,000 local shards (`Too many open
files`). `FILES` keeps at most `limit` of them open for the whole process, all readers
together (a mixture has one reader per dataset): opening one more closes the least recently
used, and a file closed that way is opened again when next read. A read pins its descriptor
for the moment of the read, so a file is never closed under a read in progress (nor its
number reused for another file).
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable

MOST = 256  # files open at once, at most; fewer under a low RLIMIT_NOFILE (a quarter of it)
Key = tuple[int, int]  # (owner: a reader's number, the file's number in it)


def default_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MOST if soft == resource.RLIM_INFINITY else max(2, min(MOST, soft // 4))


class Descriptors:
    """Open files by key (owner, file), least recently used closed first beyond `limit`."""

    def __init__(self, limit: int | None = None):
        self.limit = limit or default_limit()
        self._lock = threading.Lock()
        self._open: OrderedDict[Key, int] = OrderedDict()  # key -> descriptor, least recently used first
        self._reads: dict[int, int] = {}  # descriptor -> reads in progress
        self._doomed: set[int] = set()  # closed by their last read in progress

    def acquire(self, key: Key, opener: Callable[[], int]) -> int:
        """The descriptor of `key` (opened by `opener` if it is not open), pinned until `release`."""
        with self._lock:
            fd = self._open.get(key)
            if fd is None:
                fd = opener()
                self._open[key] = fd
                while len(self._open) > self.limit:
                    self._close(self._open.popitem(last=False)[1])
            else:
                self._open.move_to_end(key)
            self._reads[fd] = self._reads.get(fd, 0) + 1
            return fd

    def release(self, fd: int) -> None:
        with self._lock:
            left = self._reads.pop(fd) - 1
            if left:
                self._reads[fd] = left
            elif fd in self._doomed:
                self._doomed.discard(fd)
                os.close(fd)

    def adopt(self, key: Key, fd: int) -> None:
        """Keep `fd`, just opened, as `key`'s."""
        self.release(self.acquire(key, lambda: fd))

    def forget(self, owner: int) -> None:
        """Close the files of `owner` (a reader closing)."""
        with self._lock:
            for key in [k for k in self._open if k[0] == owner]:
                self._close(self._open.pop(key))

    def count(self) -> int:
        return len(self._open)

    def _close(self, fd: int) -> None:
        if fd in self._reads:
            self._doomed.add(fd)
        else:
            os.close(fd)

    def _after_fork(self) -> None:
        """In a forked child: a fresh lock (another thread may have held the parent's), and
        the inherited copies of the parent's files closed: they belong to its readers."""
        self._lock = threading.Lock()
        for fd in [*self._open.values(), *self._doomed]:
            os.close(fd)
        self._open.clear()
        self._reads.clear()
        self._doomed.clear()


FILES = Descriptors()
os.register_at_fork(after_in_child=FILES._after_fork)
