"""First-byte latencies this process has seen, by store and endpoint: what a reader's hedges
are timed by (fetch.py). A process's readers share them, so a new pass (a new epoch in a
persistent worker) hedges from its first GET; a DataLoader worker forked from a process that
read the dataset's index starts with that read's latency, so it hedges from its first GET too."""

from __future__ import annotations

import os
import threading
from collections import deque

SEEN = 256  # latencies kept a store and endpoint, for the percentiles
_SEEN: dict[tuple[str, str], deque[float]] = {}
LOCK = threading.Lock()  # held to read or add to a history


def history(store: str, endpoint: str) -> deque[float]:
    """The latencies seen at `endpoint` of the store named `store` (add to it under LOCK)."""
    with LOCK:
        return _SEEN.setdefault((store, endpoint), deque(maxlen=SEEN))


def record(store: str, endpoint: str, seconds: float) -> None:
    found = history(store, endpoint)
    with LOCK:
        found.append(seconds)


def _after_fork() -> None:
    global LOCK  # a worker forked while a thread held it would wait on it forever
    LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)
