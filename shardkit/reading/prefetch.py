"""Read-ahead: keep byte-range reads in flight on background threads while the worker
decodes, bounded by a count and a byte budget. Format- and storage-blind: it takes a fetch
function, so tests can hand it one that sleeps or fails.

How many reads are in flight adapts, so that read-ahead never costs the consumer:

- The read the consumer needs next is always the oldest one sent, and reading starts with
  one read alone: the first block gets the whole bandwidth, not a share of it. (Unless the
  consumer needs several before it can begin: a shuffled stream's first window draws its
  samples from every range it spans, and these go out together, one round trip for all.)
- From there it ramps up, doubling with each range taken (TCP's slow start: a short epoch
  or a resume must not spend its first blocks at depth 1), and, while the consumer waits
  for a streaming range's bytes, with each round trip it waits, as long as the last
  doubling brought a quarter more bytes a second than the best round before (`stalling`:
  BBR's start-up; the reads in flight do not carry the consumer's rate; on a link that caps
  each connection only more of them do, and waiting for the range to be taken first cost
  a 20 MB/s-a-connection link half a second of six connections at an epoch's start; where
  the link or the store is what is full, more reads would only queue), towards what
  Little's law asks for:
  in flight = arrival rate x latency, the arrival rate being how fast the consumer would
  take ranges on its own (its waits for bytes not counted: they are what read-ahead failed
  to hide) and the latency how long a fetch takes (moving averages). A slow store gets more
  reads in flight, a fast one fewer; never more than `depth`.
- A store that says it is overloaded (`pressure` counts its throttled answers) halves the
  ceiling on reads in flight; each read taken without one raises it by 1/ceiling (AIMD, as
  TCP does), so a throttled store sees fewer requests until it copes.

With `streaming`, a fetch may hand over what it fetches before it is done (bytes arriving
into a buffer the consumer reads from as they come: stream-through); it counts as in
flight until it returns.

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
MIN_ROUND_TRIP_S = 0.02  # `stalling` doubles the reads in flight at most this often...
GROWTH = 1.25  # ...while each doubling brings this much more (BBR's start-up)


class _Threads:
    """Daemon threads running what is submitted, in order: started as the work needs them (a
    fetch waiting and none idle), `n` at most. Unlike ThreadPoolExecutor's threads,
    interpreter exit does not wait for them (a fetch stuck on a stalled connection would hold
    it up)."""

    def __init__(self, n: int):
        self._n, self._started, self._idle = n, 0, 0
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], None]] | None] = queue.SimpleQueue()

    def run(self, fut: Future[Any], fn: Callable[[], None]) -> None:
        """Run `fn` (which settles `fut` and raises nothing) unless `fut` is cancelled first."""
        with self._lock:
            grow = self._idle == 0 and self._started < self._n
            if grow:
                name = f"shardkit-prefetch_{self._started}"
                self._started += 1
            else:
                self._idle -= 1  # this job takes an idle thread (or queues behind the busy ones)
        self._jobs.put((fut, fn))
        if grow:
            threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            if fut.set_running_or_notify_cancel():  # False: cancelled while queued
                fn()
            with self._lock:
                self._idle += 1

    def shutdown(self) -> None:
        """Let the threads end once they are done with what they run now."""
        for _ in range(self._started):
            self._jobs.put(None)


def _ignore(data: Any) -> None:
    pass


class Prefetcher(Generic[R, D]):
    """Iterate over `(request, fetch(request))` with up to `depth` fetches in flight and at
    most `budget` bytes (as `size(request)` counts them) fetched but not yet consumed
    (the first request is always allowed, however large).

    depth=0 fetches synchronously in the consumer (no threads): read-ahead off.
    threads=False issues the fetches `depth` requests ahead but in the consumer's thread:
    right when a fetch only starts the I/O and returns (posix_fadvise WILLNEED on a local file),
    where a thread hand-off would cost more than it hides.
    streaming=True calls `fetch(request, hand_over)` (see the module docstring).
    `pressure()`, if given, counts the store's throttled answers so far. `start` reads go
    out at once, before any is taken (1 unless the consumer needs several to begin).
    `stalled()`, if given, counts the seconds the consumer has waited for a streaming
    range's bytes: not its own time, so not part of the rate Little's law asks for.
    `round_trip()`, if given, is a read's first-byte latency, how often `stalling` doubles,
    and `arrived()` the bytes the fetches have brought so far, by which it tells whether
    the last doubling paid.
    """

    def __init__(
        self,
        requests: Iterable[R],
        fetch: Callable[..., D],
        size: Callable[[R], int],
        *,
        depth: int,
        budget: int,
        threads: bool = True,
        streaming: bool = False,
        pressure: Callable[[], int] | None = None,
        start: int = 1,
        stalled: Callable[[], float] | None = None,
        round_trip: Callable[[], float] | None = None,
        arrived: Callable[[], int] | None = None,
    ):
        if depth < 0 or budget < 1:
            raise ValueError("depth must be >= 0 and budget >= 1")
        self._requests = iter(requests)
        self._fetch, self._size, self._streaming = fetch, size, streaming
        self._pressure, self._stalled = pressure or (lambda: 0), stalled or (lambda: 0.0)
        self._round_trip, self._arrived = round_trip or (lambda: 0.0), arrived or (lambda: 0)
        self._round = (0.0, 0)  # when `stalling`'s round began, and the bytes arrived by then
        self._best = 0.0  # the most bytes a second of a round so far
        self.depth, self.budget, self.threads = depth, budget, threads
        self.target = min(depth, max(1, start))  # reads to keep in flight now (adapted)
        self.ceiling = float(depth)  # lowered when the store throttles (AIMD)
        self.latency_s = 0.0  # moving average of one fetch
        self.interval_s = 0.0  # moving average of the consumer's own time on one range
        self.rate = 0.0  # moving average of the bytes a second the consumer takes on its own
        self.waiting = 0.0  # moving average of the share of a range's time the consumer waited for its bytes
        self._pool: _Threads | None = None
        self._pending: deque[tuple[R, Future[D], threading.Event]] = deque()  # sent, not yet taken
        self._streaming_on: list[threading.Event] = []  # fetches taken and still streaming
        self._latencies: queue.SimpleQueue[float] = queue.SimpleQueue()  # of fetches done, from their threads
        self._pressed = 0  # the pressure seen at the last take
        self._held = 0  # bytes of requests submitted and not yet handed to the consumer
        self._next: R | None = None  # the request to submit next, once the budget allows

    def _get(self, req: R) -> D:
        return self._fetch(req, _ignore) if self._streaming else self._fetch(req)

    def _run(self, req: R, out: Future[D], done: threading.Event) -> None:
        """One fetch, on a read-ahead thread: `out` gets what it hands over (or returns, or
        raises; an error after the hand-over is the handed-over object's to carry), `done`
        is set when it returns."""
        start = time.perf_counter()
        try:
            data = self._fetch(req, out.set_result) if self._streaming else self._fetch(req)
            settle = functools.partial(out.set_result, data)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            settle = functools.partial(out.set_exception, e)
        self._latencies.put(time.perf_counter() - start)  # known before the consumer adapts to the result
        if not out.done():
            settle()
        done.set()

    def __iter__(self) -> Iterator[tuple[R, D]]:
        if self.depth == 0:
            for req in self._requests:
                yield req, self._get(req)
            return
        if not self.threads:
            yield from self._ahead_in_place()
            return
        self._pool = _Threads(self.depth)
        self._round = (time.perf_counter(), self._arrived())  # the first reads' round
        try:
            while True:
                self._fill()
                if not self._pending:
                    return
                req, fut, done = self._pending.popleft()
                data = fut.result()
                self._streaming_on.append(done)
                self._held -= self._size(req)
                handed, stalled = time.perf_counter(), self._stalled()
                yield req, data
                spent, waited = time.perf_counter() - handed, self._stalled() - stalled
                if spent > 0:
                    self.waiting += _ALPHA * (waited / spent - self.waiting)
                self._adapt(spent - waited, self._size(req))
        finally:
            self.close()

    def _ahead_in_place(self) -> Iterator[tuple[R, D]]:
        ahead: deque[tuple[R, D]] = deque()
        for req in self._requests:
            ahead.append((req, self._get(req)))
            if len(ahead) > self.depth:
                yield ahead.popleft()
        yield from ahead

    def _adapt(self, busy: float, size: int) -> None:
        """After the consumer spent `busy` seconds of its own on a range (waiting for the
        range's bytes or for the next range not counted: read-ahead is there to hide them)."""
        while not self._latencies.empty():
            latency = self._latencies.get()
            self.latency_s += _ALPHA * (latency - self.latency_s) if self.latency_s else latency
        self.interval_s += _ALPHA * (busy - self.interval_s) if self.interval_s else busy
        if busy > 0:
            self.rate += _ALPHA * (size / busy - self.rate) if self.rate else size / busy
        pressed = self._pressure()
        if pressed > self._pressed:  # throttled since the last take: halve
            self.ceiling = max(1.0, self.ceiling / 2)
        else:
            self.ceiling = min(float(self.depth), self.ceiling + 1 / self.ceiling)
        self._pressed = pressed
        wanted = math.ceil(self.latency_s / max(self.interval_s, 1e-6)) + 1 if self.latency_s else 1
        self.target = max(1, min(2 * self.target, wanted, int(self.ceiling)))  # doubling up, down at once

    def stalling(self) -> None:
        """Called from the consumer's thread while it waits for the bytes of a range it took
        (between takes, so nothing else runs the read-ahead meanwhile): at the end of each
        round trip (at least `MIN_ROUND_TRIP_S`), if the round brought `GROWTH` times the
        bytes a second of the best round before, the target doubles (within the AIMD
        ceiling) and what it allows is sent at once."""
        now, (began, before) = time.perf_counter(), self._round
        if self._pool is None or now - began < max(self._round_trip(), MIN_ROUND_TRIP_S):
            return
        arrived = self._arrived()
        rate, self._round = (arrived - before) / (now - began), (now, arrived)
        if rate < GROWTH * self._best:
            return  # more reads in flight brought no more bytes: the link is full, not the reads
        self._best = rate
        self.target = max(self.target, min(2 * self.target, int(self.ceiling), self.depth))
        self._fill()

    def _fill(self) -> None:
        """Submit requests while fewer than the target are in flight and under the byte
        budget: a request that would take what is held past the budget waits, unless
        nothing is held. The consumer waits for the next range only once it has taken all
        sent: that one is sent then, whatever streams on."""
        self._streaming_on = [done for done in self._streaming_on if not done.is_set()]
        while not self._pending or len(self._pending) + len(self._streaming_on) < self.target:
            if self._next is None:
                self._next = next(self._requests, None)
            req = self._next
            if req is None or (self._pending and self._held + self._size(req) > self.budget):
                return
            assert self._pool is not None
            out: Future[D] = Future()
            done = threading.Event()
            self._pool.run(out, functools.partial(self._run, req, out, done))
            self._pending.append((req, out, done))
            self._held += self._size(req)
            self._next = None

    def close(self) -> None:
        """Stop: queued fetches are cancelled, running ones finish in the background."""
        for _, fut, _ in self._pending:
            fut.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
