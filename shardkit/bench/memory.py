"""Memory of a process tree, sampled while it runs: `PeakRss` (peak VmRSS, and peak memory
in use: each page once, no page cache), read from /proc (Linux)."""

from __future__ import annotations

import os
import threading


def rss(pid: int) -> int:
    """Resident set size of a process in bytes (0 when it is gone, or without /proc)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def in_use(pid: int) -> int:
    """Anonymous and shared memory of a process in bytes, each page divided among the processes
    that map it (/proc/PID/smaps_rollup's Pss_Anon + Pss_Shmem): summed over a process tree,
    every page it maps counts once, and no page cache. 0 when it is gone, or without /proc."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Pss_Anon:", b"Pss_Shmem:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


class PeakRss:
    """Samples the memory of process `pid` (default: this one) and its descendants (DataLoader
    workers) every `interval` seconds from a thread; keeps the peaks. Linux only: elsewhere
    peaks stay None. `peak_total` sums VmRSS: a copy-on-write page shared by several processes
    counts in each, so it is an upper bound. `peak_in_use` sums `in_use`: each page the tree
    maps once, page cache not counted, and nothing else the machine runs."""

    def __init__(self, interval: float = 0.05, pid: int | None = None):
        self.interval = interval
        self.pid = os.getpid() if pid is None else pid
        self.available = os.path.exists(f"/proc/{self.pid}/status")
        self.peak_main: int | None = None
        self.peak_total: int | None = None
        self.peak_in_use: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        if not self.available:
            return
        tree, todo = [self.pid], _children(self.pid)
        while todo:
            pid = todo.pop()
            if pid not in tree:
                tree.append(pid)
                todo.extend(_children(pid))
        main = rss(self.pid)
        self.peak_main = max(self.peak_main or 0, main)
        self.peak_total = max(self.peak_total or 0, main + sum(rss(pid) for pid in tree[1:]))
        self.peak_in_use = max(self.peak_in_use or 0, sum(in_use(pid) for pid in tree))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        self.sample()
        if self.available:
            self._thread = threading.Thread(target=self._run, name="shardkit-bench-rss", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()
