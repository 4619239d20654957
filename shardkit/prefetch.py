"""Read-ahead: keep several byte-range reads in flight on background threads while the
worker decodes, bounded by a count and a byte budget. Format- and storage-blind: it takes a
fetch function, so tests can hand it one that sleeps or fails.

The number of reads in flight adapts by Little's law: in flight = arrival rate x latency,
where the arrival rate is how fast the consumer takes ranges and the latency is how long
a fetch takes (both moving averages). A slow store (high first-byte latency) gets more
reads in flight, a fast one fewer; never more than `depth`.

Results come back in request order. A failed fetch is re-raised in the consumer, at the
position of the request that failed. Closing the iterator cancels what is queued; a fetch
already running is left to finish on its own (daemon) thread, which interpreter exit does
not wait for.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

R = TypeVar("R")  # a request
D = TypeVar("D")  # what fetching it gives
T = TypeVar("T")

_ALPHA = 0.2  # weight of the newest observation in the moving averages


class _Threads:
    """Daemon threads running what is submitted, in order. Unlike ThreadPoolExecutor's
    threads, interpreter exit does not wait for them (a fetch stuck on a stalled connection
    would hold it up)."""

    def __init__(self, n: int):
        self._n = n
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"shardkit-prefetch_{i}", daemon=True).start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fut, fn))
        return fut

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            if fut.set_running_or_notify_cancel():  # False: cancelled while queued
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                    fut.set_exception(e)

    def shutdown(self) -> None:
        """Let the threads end once they are done with what they run now."""
        for _ in range(self._n):
            self._jobs.put(None)


class Prefetcher(Generic[R, D]):
    """Iterate over `(request, fetch(request))` with up to `depth` fetches in flight and at
    most `budget` bytes (as `size(request)` counts them) fetched but not yet consumed
    (the first request is always allowed, however large).

    depth=0 fetches synchronously in the consumer (no threads): read-ahead off.
    threads=False issues the fetches `depth` requests ahead but in the consumer's thread:
    right when a fetch only starts the I/O and returns (posix_fadvise WILLNEED on a local file),
    where a thread hand-off would cost more than it hides.
    """

    def __init__(self, requests: Iterable[R], fetch: Callable[[R], D], size: Callable[[R], int], *,
                 depth: int, budget: int, threads: bool = True):
        if depth < 0 or budget < 1:
            raise ValueError("depth must be >= 0 and budget >= 1")
        self._requests = iter(requests)
        self._fetch, self._size = fetch, size
        self.depth, self.budget, self.threads = depth, budget, threads
        self.target = depth  # reads to keep in flight now (adapted)
        self.latency_s = 0.0  # moving average of one fetch
        self.interval_s = 0.0  # moving average of the time between the consumer's takes
        self._pool: _Threads | None = None
        self._pending: deque[tuple[R, Future[tuple[D, float]]]] = deque()
        self._held = 0  # bytes of requests submitted and not yet handed to the consumer
        self._next: R | None = None  # the request to submit next, once the budget allows

    def _timed(self, req: R) -> tuple[D, float]:
        start = time.perf_counter()
        data = self._fetch(req)
        return data, time.perf_counter() - start

    def __iter__(self) -> Iterator[tuple[R, D]]:
        if self.depth == 0:
            for req in self._requests:
                yield req, self._fetch(req)
            return
        if not self.threads:
            yield from self._ahead_in_place()
            return
        self._pool = _Threads(self.depth)
        last = time.perf_counter()
        try:
            while True:
                self._fill()
                if not self._pending:
                    return
                req, fut = self._pending.popleft()
                data, took = fut.result()
                self._held -= self._size(req)
                now = time.perf_counter()
                self._adapt(took, now - last)
                last = now
                yield req, data
        finally:
            self.close()

    def _ahead_in_place(self) -> Iterator[tuple[R, D]]:
        ahead: deque[tuple[R, D]] = deque()
        for req in self._requests:
            ahead.append((req, self._fetch(req)))
            if len(ahead) > self.depth:
                yield ahead.popleft()
        yield from ahead

    def _adapt(self, latency: float, interval: float) -> None:
        self.latency_s += _ALPHA * (latency - self.latency_s) if self.latency_s else latency
        self.interval_s += _ALPHA * (interval - self.interval_s) if self.interval_s else interval
        wanted = math.ceil(self.latency_s / max(self.interval_s, 1e-6)) + 1
        self.target = max(1, min(self.depth, wanted))

    def _fill(self) -> None:
        """Submit requests while under the target depth and the byte budget: a request that
        would take what is held past the budget waits, unless nothing is held."""
        while len(self._pending) < self.target:
            if self._next is None:
                self._next = next(self._requests, None)
            req = self._next
            if req is None or (self._pending and self._held + self._size(req) > self.budget):
                return
            assert self._pool is not None
            self._pending.append((req, self._pool.submit(functools.partial(self._timed, req))))
            self._held += self._size(req)
            self._next = None

    def close(self) -> None:
        """Stop: queued fetches are cancelled, running ones finish in the background."""
        for _, fut in self._pending:
            fut.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
