"""Stream-through reads: a range's bytes readable while they arrive.

`Arriving` is the buffer a read-ahead thread fills and the worker reads from: a read of
bytes that have not come yet waits for them (or for the error that stopped them), so a
sample is parsed as soon as its own bytes are in, not when its whole block is.
The stores (stores/) fill them, each by its own client. Their memory is the process's
`BUFFERS`, kept for the next range once a range has been read (`Arriving.release`).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable

ReadAt = Callable[[int, int], bytes]  # read_at(size, offset): a shard's bytes, as formats.tar reads them


class Buffers:
    """Memory for `Arriving` buffers: private anonymous mappings, each kept for the next
    buffer once its range has been read. The kernel zeroes a mapping's pages as they are
    first written, a fault a page: measured here (16 MB written in 256-KB chunks, as a
    socket fills it), 1.25 CPU s a GB for mmap's default shared mapping, 0.7 for a private
    one, 0.04 for one written before; huge pages (madvise) cost more than they saved, the
    kernel compacting memory to find them. Sizes are powers of two from `POOLED` (a buffer
    holds at most twice its bytes); at most `KEEP` bytes are kept free (fewer than a
    worker's read-ahead holds at its peak), none once the process's last reader has closed
    (`closing`), and a forked child keeps none of its parent's."""

    POOLED = 1 << 20  # smaller buffers (a fingerprint's 512 bytes) are mapped each time
    KEEP = 256 << 20  # the read-ahead's default budget (prefetch_bytes)

    def __init__(self) -> None:
        self._after_fork()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[mmap.mmap]] = {}
        self._kept = self._readers = 0

    def take(self, size: int) -> mmap.mmap:
        """A mapping of at least `size` bytes, kept or new."""
        if size < self.POOLED:
            return _mapping(size)
        cls = 1 << (size - 1).bit_length()
        with self._lock:
            if free := self._free.get(cls):
                self._kept -= cls
                return free.pop()
        return _mapping(cls)

    def give(self, buf: mmap.mmap) -> None:
        """`buf` back for the next `take`, or let go (unmapped once its views are gone)."""
        cls = len(buf)
        with self._lock:
            if self.POOLED <= cls and self._readers and self._kept + cls <= self.KEEP:
                self._free.setdefault(cls, []).append(buf)
                self._kept += cls

    def opening(self) -> None:
        with self._lock:
            self._readers += 1

    def closing(self) -> None:
        """A reader opened in this process (`opening`) has closed."""
        with self._lock:
            self._readers = max(0, self._readers - 1)
            if not self._readers:
                self._free.clear()
                self._kept = 0


def _mapping(size: int) -> mmap.mmap:
    return mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


BUFFERS = Buffers()
_RELEASED = memoryview(b"")  # a released buffer's view: reading it is an error


class Stalls:
    """Seconds the reader of some `Arriving` buffers spent waiting for their bytes: what
    read-ahead did not hide (one reader thread adds to it). With `waiting`, a reader that
    waits calls it every `every_s` seconds of its wait, on its own thread and without the
    buffer's lock (the read-ahead sends more reads then: reading/prefetch.py)."""

    def __init__(self, waiting: Callable[[], None] | None = None, every_s: float = 0.01) -> None:
        self.seconds = 0.0
        self.waiting, self.every_s = waiting, every_s


class Piece:
    """Bytes [lo, hi) of an `Arriving` buffer, filled in order by one writer (one GET):
    `write` hands it chunks, `receive` a `readinto` to fill it from (no copy on our side)."""

    def __init__(self, arriving: Arriving, lo: int, hi: int):
        self.lo, self.hi, self.filled = lo, hi, 0
        self._arriving = arriving
        self._view = arriving._view[lo - arriving.start : hi - arriving.start]

    def write(self, chunk: bytes) -> None:
        n = min(len(chunk), len(self._view) - self.filled)  # a server that sends more is cut to the piece
        self._view[self.filled : self.filled + n] = memoryview(chunk)[:n]
        self._arriving._advanced(self, n)

    def receive(self, readinto: Callable[[memoryview], int]) -> None:
        """Fill from `readinto(view) -> bytes put there`, as a socket or an HTTP response
        gives them, until full or it gives none."""
        while self.filled < len(self._view) and (n := readinto(self._view[self.filled :])):
            self._arriving._advanced(self, n)

    @property
    def full(self) -> bool:
        return self.filled == self.hi - self.lo

    @property
    def awaited(self) -> bool:
        """Whether a reader waits for bytes of this piece now (not a read-ahead's yet)."""
        return self._arriving.awaits(self.lo + self.filled)


class Arriving:
    """Bytes [start, stop) of a shard, filled by one writer or by several, each its own
    `Piece` of it (parallel ranged GETs: `split`), then `finish`ed; read by others with
    `read_at(size, offset)`, as `formats.tar` reads: a read waits for its bytes (counted in
    `stalls`); fewer come back only where the shard ends (`finish(end=...)`). `filled` is
    the bytes in from `start` without a gap. Calling it is `read_at`. Once finished and
    `release`d by its reader, its memory goes back to `BUFFERS`."""

    def __init__(self, start: int, stop: int, stalls: Stalls | None = None):
        self.start, self.stop, self._stalls = start, stop, stalls
        self.filled = 0  # bytes in from `start`, without a gap
        # anonymous memory, zeroed by the kernel as it is first written (a bytearray is zeroed up front)
        self._buf: mmap.mmap | None = BUFFERS.take(stop - start)
        self._view = memoryview(self._buf)[: stop - start]
        self._released = False
        self._end = stop  # where the shard ends, if before `stop`
        self._done = False
        self._error: BaseException | None = None
        self._cond = threading.Condition(threading.Lock())
        self._wanted = -1  # the bytes a waiting reader needs in: woken once, not at every chunk
        self.pieces = [Piece(self, start, stop)]
        self._gapless = 0  # the first piece not yet full
        self.counted: Callable[[int], None] | None = None  # told of each byte that comes, before a reader sees it

    def awaits(self, offset: int) -> bool:
        """Whether a reader waits for the byte at `offset` (a glance without the lock)."""
        return 0 <= offset - self.start < self._wanted

    def split(self, bounds: list[int]) -> list[Piece]:
        """Cut the range into pieces at `bounds` (start < b1 < ... < stop), before any byte."""
        assert not self.filled and bounds[0] == self.start and bounds[-1] == self.stop
        self.pieces = [Piece(self, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        return self.pieces

    def write(self, chunk: bytes) -> None:
        self.pieces[0].write(chunk)

    def receive(self, readinto: Callable[[memoryview], int]) -> None:
        self.pieces[0].receive(readinto)

    def _advanced(self, piece: Piece, n: int) -> None:
        if self.counted is not None:
            self.counted(n)
        with self._cond:
            piece.filled += n
            pieces = self.pieces
            while self._gapless < len(pieces) and pieces[self._gapless].full:
                self._gapless += 1
            first = pieces[self._gapless] if self._gapless < len(pieces) else None
            self.filled = first.lo - self.start + first.filled if first is not None else self.stop - self.start
            if 0 <= self._wanted <= self.filled:
                self._wanted = -1
                self._cond.notify_all()

    def adopt(self, data: bytes) -> None:
        """All the bytes at once (a store that does not stream, a cache hit), kept rather
        than copied, and finished: the shard ends where they do, if before `stop`."""
        with self._cond:
            self._view = memoryview(data)[: self.stop - self.start]  # before `filled`: readers check that
            self.filled = len(self._view)
            self._end = min(self._end, self.start + self.filled)
            self._done = True
            self._cond.notify_all()
            self._recycle(written=False)

    def finish(self, error: BaseException | None = None, end: int | None = None) -> None:
        """No more bytes: all of them, the shard ended at `end`, or `error` stopped them."""
        with self._cond:
            self._done, self._error = True, error
            if end is not None:
                self._end = min(self._end, end)
            self._cond.notify_all()
            self._recycle()

    def release(self) -> None:
        """Its reader is done with it: once finished (no writer left), its memory is reused."""
        with self._cond:
            self._released = True
            self._recycle()

    def _recycle(self, written: bool = True) -> None:
        """The buffer back to BUFFERS once nobody may touch it (the lock held): no writer
        (finished) and no reader (released), or never written (`adopt`)."""
        if self._buf is not None and self._done and (self._released or not written):
            buf, self._buf, self.pieces = self._buf, None, []
            if written:
                self._view = _RELEASED
            BUFFERS.give(buf)

    def read_at(self, size: int, offset: int) -> bytes:
        lo = offset - self.start
        hi = min(lo + size, self._end - self.start)
        if self.filled < hi:
            began, stalls = time.perf_counter(), self._stalls
            waiting = stalls.waiting if stalls is not None else None
            with self._cond:
                while self.filled < hi and not self._done:
                    self._wanted = hi if self._wanted < 0 else min(self._wanted, hi)
                    if not self._cond.wait(stalls.every_s if waiting and stalls else None) and waiting:
                        self._cond.release()
                        try:
                            waiting()
                        finally:
                            self._cond.acquire()
                if stalls is not None:
                    stalls.seconds += time.perf_counter() - began
                hi = min(hi, self._end - self.start)
                if self.filled < hi:
                    assert self._error is not None
                    raise self._error
        if self._view is _RELEASED:  # never bad data: a bug of the reader's, not the shard's
            raise RuntimeError(f"a read of bytes {offset}-{offset + size} after their buffer was released")
        return bytes(self._view[lo : max(lo, hi)])

    __call__ = read_at

    def data(self) -> bytes:
        """The bytes in, once finished without an error (for the cache)."""
        return bytes(self._view[: self.filled])
