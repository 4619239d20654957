"""What a DataLoader worker does before its first sample: freeze what it inherited.

A forked DataLoader worker starts with every object of the main process, torch's hundreds of
thousands included. Python's full garbage collection walks all of them and writes to each
one's header, so the worker's first full collection copies every page of them from its
parent (copy-on-write): 100-140 ms here, in the middle of the first batch. `gc.freeze()`
moves what a process holds to the permanent generation, so its collections only ever walk
what it makes afterwards. CPython's documentation recommends it for fork without exec (there
in the parent, just before the fork; here in the child, so the process that forks is left
as it is).

Two moments, because each alone misses workers:
- right after the fork (`os.register_at_fork`, registered by importing shardkit's readers):
  a worker's own first allocations can run that full collection before any code of ours,
  whenever the main process's collection counters sit at their thresholds at the fork (an
  unrelated change made it so, +100 ms to the first batch). It applies to every process
  forked afterwards: such a child never collects what it inherited, which lives as long as
  the child anyway.
- at the worker's first sample (`settle`), for workers that were not forked (spawn,
  forkserver): they import torch themselves, and freezing it spares their collections too.
"""

from __future__ import annotations

import gc
import os

from torch.utils.data import get_worker_info

os.register_at_fork(after_in_child=gc.freeze)

_settled_pid: int | None = None


def settle() -> None:
    """In a DataLoader worker, the first time it is called in that process: `gc.freeze()`.
    Elsewhere (the user's own process) nothing: its garbage collection is the user's."""
    global _settled_pid
    if _settled_pid == os.getpid() or get_worker_info() is None:
        return
    _settled_pid = os.getpid()
    gc.freeze()
