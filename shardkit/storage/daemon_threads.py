"""The daemon threads a reader's fetch engine (fetch.py) runs on: a pool that runs what is
submitted in order, and a timer that calls a function at its time."""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DaemonThreads:
    """Daemon threads running what is submitted, in order (interpreter exit does not wait
    for a GET stuck on a stalled connection)."""

    def __init__(self, n: int, name: str):
        self._n = n
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        for i in range(n):
            threading.Thread(target=self._work, name=f"shardkit-{name}_{i}", daemon=True).start()

    def submit(self, fn: Callable[[], Any], fut: Future[Any] | None = None) -> Future[Any]:
        fut = fut if fut is not None else Future()
        self._jobs.put((fut, fn))
        return fut

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the waiter raises it
                fut.set_exception(e)

    def shutdown(self) -> None:
        for _ in range(self._n):
            self._jobs.put(None)


class DaemonTimer:
    """One thread that calls each function handed to `at` at its time, unless cancelled first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, list[Callable[[], None] | None]]] = []
        self._cond = threading.Condition()
        self._count = itertools.count()
        self._closed = False
        threading.Thread(target=self._run, name="shardkit-hedge-timer", daemon=True).start()

    def at(self, when: float, fn: Callable[[], None]) -> list[Callable[[], None] | None]:
        """Call `fn` at `when` (perf_counter); the handle's [0] = None cancels it."""
        handle: list[Callable[[], None] | None] = [fn]
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._count), handle))
            self._cond.notify()
        return handle

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.perf_counter()):
                    self._cond.wait(self._heap[0][0] - time.perf_counter() if self._heap else None)
                if self._closed:
                    return
                _, _, handle = heapq.heappop(self._heap)
            fn = handle[0]
            if fn is not None:
                fn()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
