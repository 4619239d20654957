"""The fetch engine of a reader: how a remote range is cut into parallel GETs, and the
GETs stuck in the latency tail sent again.

Object stores cap each connection (tens of MB/s to ~100 MB/s on S3 and GCS) and answer a
few percent of requests late (hundreds of ms to seconds). So:

- Pieces, sized by throughput: where the consumer waits for the bytes of the ranges it
  reads (more than `SPLIT_WAITING` of its time: the ranges in flight do not carry its rate),
  a range is cut into as many pieces as it takes for their connections together to carry
  the consumer's own rate with half as much again to spare (`wanted()`: the read-ahead's
  measures, bytes a second it takes when not waiting, and the share of time it waits), each
  piece at least a connection's bandwidth-delay product (throughput x first-byte latency,
  and 1 MB) so that first bytes do not eat its time. Where it does not wait, one piece a
  range: more requests would cost the store and the client for nothing. The figures are
  moving averages of every GET (its first byte, then its body's bytes a second); until
  they are known, a range is one GET (reading ramps up from one request: measured here, a
  first range cut in four cost the first batch more on a loaded machine than it saved). The pieces of a range run on the engine's threads
  (`connections` of them), first in, first out: the range the consumer needs next is ahead
  of those after it. How many ranges are in flight stays the read-ahead's (reading/prefetch.py:
  Little's law on the range's whole fetch time, AIMD on throttling); a store that throttles
  also halves how many pieces a range may take (and each range without one adds one back).
- Hedges: a GET whose first byte has not come after about the p95 of first-byte latencies
  seen so far (but no more than 4x their median, so that a tail fat enough to reach the p95
  does not set the bar inside itself, and at least `HEDGE_FLOOR_S`; 4x the lower median
  until `P95_SEEN` are known), and whose bytes a reader waits for, is sent again; a hedge
  as late gets one more (`ATTEMPTS`: a 5% tail meets one hedge in twenty). At most
  `HEDGE_SHARE` of requests and `HEDGE_BURST` more (a short pass's few requests meet the
  tail's first few as often as a long one's: with one spare hedge, a worker of a
  2,000-image epoch that met two tails waited a whole second on the second). The bar is
  read anew while a GET waits: one sent before its process knew the store is held to what
  it knows now. A late GET of read-ahead is hedged only once its reader comes to wait for
  it: then at once. The latencies are the process's (latencies.py), the index's read among
  them: a short epoch's few GETs, which a worker makes before it has seen enough of its
  own, are hedged too. The first to answer writes the piece, and its end is the GET's; the
  others, once their own answer comes, are closed unread (a blocking HTTP read cannot be
  interrupted sooner), on threads of their own that nobody waits for. All carry the same
  pinned version (If-Match), so a hedge never reads another object.

Only the attempt that claimed a piece ever writes to it, so a hedge can neither lose nor
duplicate a byte; a failed piece is retried from where its bytes stopped by the caller.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ..errors import ShardkitError
from . import latencies
from .clients import origin
from .daemon_threads import DaemonThreads, DaemonTimer
from .retry import THROTTLED, count_throttled, root_cause, status_of, throttled_answers
from .stores import Store
from .streams import Piece

T = TypeVar("T")

MIN_PIECE = 1 << 20
HEADROOM = 1.5  # connections for the consumer's rate, and half as many again
SPLIT_WAITING = 0.5  # ranges are cut into pieces while the consumer waits more than this share of its time
CONNECTIONS = 16  # GETs one reader keeps open at most, hedges aside, where it is told nothing else
RANK_CONNECTIONS = 32  # ...and a rank's DataLoader workers together: each keeps its share (`per_worker`)
HEDGE_SHARE = 0.05  # hedges at most per request...
HEDGE_BURST = 2  # ...and this many more
HEDGE_FLOOR_S = 0.05  # never hedge a GET sooner than this
HEDGE_POLL_S = 0.02  # a late GET of read-ahead is hedged this soon after a reader starts to wait for it
P95_SEEN = 8  # first-byte latencies seen before their p95 sets the bar (before: 4x their median)
FIRST_HEDGE_S = 0.5  # a process's first small read is hedged after this (S3's first bytes: ~0.1 s with TLS)
ATTEMPTS = 3  # GETs of one piece at most: the first and two hedges (the second if the first hedge is late too)
_ALPHA = 0.1  # weight of the newest GET in the moving averages


def _history(store: Store, url: str) -> deque[float]:
    return latencies.history(store.name, origin(url, store.options))


def _bar(history: deque[float]) -> float | None:
    """The hedge bar of the first-byte latencies in `history` (None: none seen yet)."""
    with latencies.LOCK:
        seen = sorted(history)
    if not seen:
        return None
    # the lower median: of two, a tail's 1 s index read must not set a 4-s bar on the next GETs
    p50, p95 = seen[(len(seen) - 1) // 2], seen[int(0.95 * (len(seen) - 1))]
    return max(HEDGE_FLOOR_S, min(p95, 4 * p50) if len(seen) >= P95_SEEN else 4 * p50)


def first_answer(store: Store, url: str, call: Callable[[], T]) -> T:
    """`call()`, a whole read of a small object `url` (an index, an offsets file), hedged:
    sent again while no attempt has answered after the bar (`_bar` of what the process has
    seen of the store, `FIRST_HEDGE_S` before it has seen anything), `ATTEMPTS` in all;
    the first answer wins, the others end unread on their own threads. An error is raised
    once every attempt sent has failed (the first one's)."""
    bar = _bar(_history(store, url)) or FIRST_HEDGE_S
    answers: queue.SimpleQueue[tuple[int, bool, Any]] = queue.SimpleQueue()

    def attempt(me: int) -> None:
        try:
            answers.put((me, True, call()))
        except BaseException as e:  # noqa: BLE001 - raised by the caller's thread
            answers.put((me, False, e))

    sent, due, errors = 0, 0.0, []
    while True:
        if sent < ATTEMPTS and (sent == 0 or due <= time.perf_counter()):
            threading.Thread(target=attempt, args=(sent,), name="shardkit-small-read", daemon=True).start()
            sent, due = sent + 1, time.perf_counter() + bar
            if sent > 1:
                _count_open("hedges")
        try:
            me, ok, value = answers.get(timeout=max(0.0, due - time.perf_counter()) if sent < ATTEMPTS else None)
        except queue.Empty:
            continue
        if ok:
            if me:
                _count_open("hedge_wins")
            return cast(T, value)
        errors.append(value)
        if len(errors) == sent:
            raise errors[0]


_OPENS = {"hedges": 0, "hedge_wins": 0}  # `first_answer`'s, in this process
_OPENS_LOCK = threading.Lock()


def _count_open(name: str) -> None:
    with _OPENS_LOCK:
        _OPENS[name] += 1


def opening_counts() -> dict[str, int]:
    """This process's counts so far that a dataset's opening adds to its stats(): the hedges
    and hedge wins of small whole reads (`first_answer`) and every request's throttled answers."""
    with _OPENS_LOCK:
        return {**_OPENS, "throttled": throttled_answers()}


def per_worker(num_workers: int) -> int:
    """A DataLoader worker's share of its rank's connections (4 at least): the workers of one
    rank share its link rather than each opening as many as the link could carry."""
    return max(4, RANK_CONNECTIONS // max(1, num_workers))


class Lost(ShardkitError):
    """The other attempt at a piece answered first: this one stops, unread."""


class _Claim:
    """Which attempt at a piece writes it: the first to get its first byte."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by: int | None = None

    def take(self, me: int) -> bool:
        with self._lock:
            if self.by is None:
                self.by = me
            return self.by == me


class _Attempt:
    """The sink one GET of a piece writes through: it claims the piece at its first byte
    (or stops, Lost), and times the GET for the engine."""

    def __init__(self, engine: FetchEngine, piece: Piece, claim: _Claim, me: int):
        self._engine, self._piece, self._claim, self._me = engine, piece, claim, me
        self._sent = time.perf_counter()
        self._first: float | None = None
        self._from = piece.filled

    def _take(self) -> None:
        if self._first is None:
            self._first = time.perf_counter()
            self._engine.first_byte(self._first - self._sent)
            if not self._claim.take(self._me):
                raise Lost("another attempt at this piece answered first")
            if self._me:
                self._engine.won()

    def write(self, chunk: bytes) -> None:
        self._take()
        self._piece.write(chunk)

    def receive(self, readinto: Callable[[memoryview], int]) -> None:
        self._take()
        self._piece.receive(readinto)

    def done(self) -> None:
        if self._first is not None and self._claim.by == self._me:
            self._engine.body(self._piece.filled - self._from, time.perf_counter() - self._first)


class FetchEngine:
    """Pieces and hedges for one reader's remote ranges (see the module docstring)."""

    def __init__(self, connections: int = CONNECTIONS):
        self.connections = max(1, connections)
        self.requests = self.hedges = self.hedge_wins = 0
        self.latency_s = 0.0  # moving average of a GET's first byte
        self.rate = 0.0  # moving average of a connection's bytes/s, once the first byte came
        self._seen: deque[float] = deque()  # the store's history in this process, once a GET has named it
        self._lock = threading.Lock()
        self._pieces_ceiling = float(self.connections)
        self._pressed = 0
        # the consumer's own rate (bytes/s) and the share of its time it waits for bytes (set by the reader's user)
        self.wanted: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0)
        self.throttled: Callable[[], None] | None = None  # told of a hedge's throttled answer (the reader's count)
        self._pool: DaemonThreads | None = None  # the pieces of ranges after their first
        self._attempts: DaemonThreads | None = None  # the GETs, hedges included
        self._timer: DaemonTimer | None = None

    # measurements, from the GETs' threads
    def first_byte(self, seconds: float) -> None:
        with latencies.LOCK:
            self._seen.append(seconds)
        with self._lock:
            self.latency_s += _ALPHA * (seconds - self.latency_s) if self.latency_s else seconds

    def body(self, size: int, seconds: float) -> None:
        if size < MIN_PIECE // 4 or seconds <= 0:
            return  # too short to tell a connection's throughput
        with self._lock:
            rate = size / seconds
            self.rate += _ALPHA * (rate - self.rate) if self.rate else rate

    def won(self) -> None:
        with self._lock:
            self.hedge_wins += 1

    # cutting ranges
    def bounds(self, start: int, stop: int, pressure: int = 0) -> list[int]:
        """Where to cut [start, stop) into pieces; `pressure` counts the store's throttled
        answers so far (a new one halves the pieces a range may take)."""
        if pressure > self._pressed:
            self._pieces_ceiling = max(1.0, self._pieces_ceiling / 2)
        else:
            self._pieces_ceiling = min(float(self.connections), self._pieces_ceiling + 1)
        self._pressed = pressure
        size, (wanted, waiting) = stop - start, self.wanted()
        n = 1
        if self.rate and self.latency_s and waiting > SPLIT_WAITING and wanted:
            smallest = max(MIN_PIECE, self.rate * self.latency_s)  # a piece at least its connection's BDP
            n = min(math.ceil(HEADROOM * wanted / self.rate), int(size // smallest))
        n = max(1, min(n, int(self._pieces_ceiling)))
        step = -(-size // n)
        return [*range(start, stop, step), stop]

    def hedge_after(self) -> float | None:
        """Seconds without a first byte after which a GET is sent again (None: not yet)."""
        with self._lock:
            if not self._may_hedge():
                return None
        return _bar(self._seen)

    # running
    def run(self, pieces: list[Piece], fetch: Callable[[Piece], None]) -> None:
        """`fetch(piece)` for each piece: the first on this thread, the others on the
        engine's; returns once all are done, raising the first piece's error in order."""
        if len(pieces) == 1:
            fetch(pieces[0])
            return
        futures = [self._threads()[0].submit(functools.partial(fetch, p)) for p in pieces[1:]]
        errors: list[BaseException] = []
        try:
            fetch(pieces[0])
        except BaseException as e:  # noqa: BLE001 - raised after the others end, in order
            errors.append(e)
        for fut in futures:
            if (error := fut.exception()) is not None:
                errors.append(error)
        if errors:
            raise errors[0]

    def get(self, store: Store, url: str, piece: Piece, pin: dict[str, Any] | None) -> int | None:
        """One GET of the rest of `piece` through `store`, hedged when its first byte is
        late; the object's size where the answer told it. Returns (or raises) once the
        attempt that claimed the piece has ended: a loser left waiting for its first byte
        is not waited for."""
        at, claim = piece.lo + piece.filled, _Claim()
        with self._lock:
            self.requests += 1
            if not self.requests - 1:
                self._seen = _history(store, url)
        attempts, timer_thread = self._threads()[1:]
        ended = threading.Event()
        outcome: list[Any] = []  # the claiming attempt's size, or its error

        def attempt(me: int) -> None:
            sink = _Attempt(self, piece, claim, me)
            try:
                size: Any = store.get(url, at, piece.hi, sink, pin)
            except Lost:
                return
            except BaseException as e:  # noqa: BLE001 - the caller raises it (retried there)
                if me and claim.by is None:  # a hedge that failed before its first byte: the first GET is still out
                    self._dropped(e)
                    return
                size = e
            if claim.take(me):  # an attempt that ended before any byte claims the piece by ending
                if not isinstance(size, BaseException):
                    sink.done()
                outcome.append(size)
                ended.set()
            elif isinstance(size, BaseException):  # the other attempt answered first
                self._dropped(size)

        def send(me: int) -> None:
            attempts.submit(functools.partial(attempt, me))

        sent = time.perf_counter()
        send(0)
        after = self.hedge_after()
        timer_thread.at(sent + (after or HEDGE_POLL_S), functools.partial(self._hedge, claim, send, piece, sent))
        ended.wait()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0] if isinstance(outcome[0], int) else None

    def _hedge(self, claim: _Claim, send: Callable[[int], None], piece: Piece, since: float, sent: int = 1) -> None:
        """On the timer's thread, until the GET has answered: once the bar (`_bar`, read anew
        each time: a GET sent before the process knew its store's latencies is measured by
        what it knows now) has passed since `since` and a reader waits for the piece's bytes,
        send attempt `sent` (a hedge; a hedge that meets the tail too gets one more, up to
        `ATTEMPTS` in all), or stop if the hedges' share is spent; else look again every
        `HEDGE_POLL_S`. The share is spent on the GETs that hold a reader up, not on
        read-ahead that is late but still ahead of its reader (measured here: at an epoch's
        start, GETs slowed by their own number spent it before a GET in the tail came)."""
        timer = self._timer
        if claim.by is not None or timer is None or sent >= ATTEMPTS:
            return
        now, after = time.perf_counter(), _bar(self._seen)
        if after is not None and now >= since + after and piece.awaited:
            with self._lock:
                if not self._may_hedge():
                    return  # no polling on: the GET waits for its own answer
                self.hedges += 1
            send(sent)
            since, sent = now, sent + 1
        wake = since + after if after is not None and now < since + after else now + HEDGE_POLL_S
        timer.at(wake, functools.partial(self._hedge, claim, send, piece, since, sent))

    def _dropped(self, error: BaseException) -> None:
        """An attempt's error that no retry sees (another attempt is the GET's): a throttled
        answer is counted all the same, in the process's count and the reader's."""
        if status_of(root_cause(error)) in THROTTLED:
            count_throttled(self.throttled)

    def _may_hedge(self) -> bool:
        """Whether the hedges' share has room for one more (the engine's lock held)."""
        return self.hedges < HEDGE_SHARE * self.requests + HEDGE_BURST

    def _threads(self) -> tuple[DaemonThreads, DaemonThreads, DaemonTimer]:
        """(the pieces' threads, the GETs' threads, the hedges' timer), made at first use:
        room for every connection's GET and as many hedged or waiting for a late answer."""
        with self._lock:
            if self._pool is None or self._attempts is None or self._timer is None:
                self._pool = DaemonThreads(self.connections, "fetch")
                self._attempts = DaemonThreads(2 * self.connections, "get")
                self._timer = DaemonTimer()
            return self._pool, self._attempts, self._timer

    def close(self) -> None:
        with self._lock:
            for pool in (self._pool, self._attempts):
                if pool is not None:
                    pool.shutdown()
            if self._timer is not None:
                self._timer.close()
            self._pool = self._attempts = self._timer = None
