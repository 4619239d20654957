"""Fast sequential writing of large local files (shards): direct I/O from a few reused,
aligned buffers, written to disk by a thread while the caller fills the next one.

Why: a buffered write() costs more CPU than reading and hashing the same bytes (the kernel
allocates, accounts and later writes back a page-cache page per 4 KB), and freshly written
shards would push the data readers need out of the page cache. With O_DIRECT the bytes take
one memcpy into an aligned buffer and the disk reads them from there while this process
goes on. Where O_DIRECT is refused (tmpfs, some FUSE and network file systems) the same
class writes through the page cache.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

ALIGN = 4096  # O_DIRECT wants buffer address, length and file offset aligned to the block size
CHUNK = 8 << 20
DEPTH = 2  # buffers per file: one being filled while one goes to disk (more measured no faster here)


class SequentialWriter:
    """A write-only binary file written front to back; `finish` makes it durable (fsync)."""

    def __init__(self, path: str):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        try:
            self._fd = os.open(path, flags | direct, 0o644)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)  # the file system refuses direct I/O
        self._buffers = [mmap.mmap(-1, CHUNK) for _ in range(DEPTH)]  # page-aligned, reused
        self._fill = 0  # which buffer is being filled
        self._pos = 0  # bytes in it
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardkit-write")
        self._pending: deque[Future[None]] = deque()  # buffers on their way to disk, oldest first

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        n, done = len(view), 0
        while done < n:
            take = min(CHUNK - self._pos, n - done)
            self._buffers[self._fill][self._pos : self._pos + take] = view[done : done + take]
            self._pos += take
            done += take
            if self._pos == CHUNK:
                self._hand_off(CHUNK)
        return n

    def _hand_off(self, size: int) -> None:
        """Send the first `size` bytes of the filled buffer to disk in the background and
        move on to the next buffer, once its own earlier write has finished."""
        self._pending.append(self._pool.submit(self._write_out, self._buffers[self._fill], size))
        self._fill = (self._fill + 1) % DEPTH
        self._pos = 0
        if len(self._pending) == DEPTH:
            self._pending.popleft().result()  # a failed write (ENOSPC, EIO) surfaces here

    def _wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def _write_out(self, data: mmap.mmap | bytes, size: int) -> None:
        done = 0
        while done < size:
            try:
                with memoryview(data) as view:
                    done += os.write(self._fd, view[done:size])
            except OSError as e:
                if e.errno != errno.EINVAL or not self._direct():
                    raise
                self._direct_off()  # direct I/O accepted at open but refused on write

    def _direct(self) -> bool:
        return bool(fcntl.fcntl(self._fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))

    def _direct_off(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~getattr(os, "O_DIRECT", 0))

    def finish(self) -> None:
        """Write what is left and fsync. The unaligned tail goes through the page cache."""
        tail = self._pos % ALIGN
        aligned = self._pos - tail
        rest = bytes(self._buffers[self._fill][aligned : self._pos])
        if aligned:
            self._hand_off(aligned)
        self._wait()
        if rest:
            self._direct_off()
            self._write_out(rest, len(rest))
        os.fsync(self._fd)

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # never close the descriptor under a running write
        os.close(self._fd)
        for buffer in self._buffers:
            buffer.close()

    def __enter__(self) -> SequentialWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
