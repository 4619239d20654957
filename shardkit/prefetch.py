"""Read-ahead: keep several byte-range reads in flight on background threads while the
worker decodes, bounded by a count and a byte budget. Format- and storage-blind: it takes a
fetch function, so tests can hand it one that sleeps or fails.

The number of reads in flight adapts by Little's law: in flight = arrival rate x latency,
where the arrival rate is how fast the consumer takes ranges and the latency is how long
a fetch takes (both moving averages). A slow store (high first-byte latency) gets more
reads in flight, a fast one fewer; never more than `depth`.

Results come back in request order. A failed fetch is re-raised in the consumer, at the
position of the request that failed. Closing the iterator cancels what is queued.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

R = TypeVar("R")  # a request
D = TypeVar("D")  # what fetching it gives

_ALPHA = 0.2  # weight of the newest observation in the moving averages


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
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[R, Future[tuple[D, float]]]] = deque()
        self._held = 0  # bytes of requests submitted and not yet handed to the consumer
        self._exhausted = False

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
        self._pool = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="shardkit-prefetch")
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
        """Submit requests while under the target depth and (past the first) the byte budget."""
        while not self._exhausted and len(self._pending) < self.target:
            if self._pending and self._held >= self.budget:
                return
            req = next(self._requests, None)
            if req is None:
                self._exhausted = True
                return
            assert self._pool is not None
            self._pending.append((req, self._pool.submit(self._timed, req)))
            self._held += self._size(req)

    def close(self) -> None:
        """Stop: queued fetches are cancelled, running ones finish in the background."""
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
