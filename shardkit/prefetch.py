"""Read-ahead: keep several byte-range reads in flight on background threads while the
worker decodes, bounded by a count and a byte budget. Format- and storage-blind: it takes a
fetch function, so tests can hand it one that sleeps or fails.

Results come back in request order. A failed fetch is re-raised in the consumer, at the
position of the request that failed. Closing the iterator stops the threads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

R = TypeVar("R")


class Prefetcher(Generic[R]):
    """Iterate over `(request, fetch(request))` with up to `depth` fetches in flight and at
    most `budget` bytes (as `size(request)` counts them) fetched but not yet consumed.

    depth=0 fetches synchronously in the consumer (no threads): read-ahead off.
    """

    def __init__(self, requests: Iterable[R], fetch: Callable[[R], bytes], size: Callable[[R], int], *,
                 depth: int, budget: int):
        if depth < 0 or budget < 1:
            raise ValueError("depth must be >= 0 and budget >= 1")
        self._requests = iter(requests)
        self._fetch, self._size = fetch, size
        self.depth, self.budget = depth, budget
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[R, Future[bytes]]] = deque()
        self._held = 0  # bytes of requests submitted and not yet handed to the consumer
        self._exhausted = False

    def __iter__(self) -> Iterator[tuple[R, bytes]]:
        if self.depth == 0:
            for req in self._requests:
                yield req, self._fetch(req)
            return
        self._pool = ThreadPoolExecutor(max_workers=self.depth, thread_name_prefix="shardkit-prefetch")
        try:
            while True:
                self._fill()
                if not self._pending:
                    return
                req, fut = self._pending.popleft()
                data = fut.result()
                self._held -= self._size(req)
                yield req, data
        finally:
            self.close()

    def _fill(self) -> None:
        """Submit requests while under the depth and (past the first) the byte budget."""
        while not self._exhausted and len(self._pending) < self.depth:
            if self._pending and self._held >= self.budget:
                return
            req = next(self._requests, None)
            if req is None:
                self._exhausted = True
                return
            assert self._pool is not None
            self._pending.append((req, self._pool.submit(self._fetch, req)))
            self._held += self._size(req)

    def close(self) -> None:
        """Stop: queued fetches are cancelled, running ones finish in the background."""
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
