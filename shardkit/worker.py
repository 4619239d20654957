"""What a DataLoader worker process does once, before its first sample.

A forked worker starts with every object of the main process, torch's hundreds of thousands
included. Python's full garbage collection walks all of them and writes to each one's
header, so the worker's first full collection copies every page of them from its parent
(copy-on-write) and took ~140 ms here: it landed in the first batch and delayed it by that
much. `gc.freeze()` moves what the worker inherited to the permanent generation, so its
collections only ever walk what the worker itself made. Those inherited objects live as
long as the worker anyway.
"""

from __future__ import annotations

import gc
import os

from torch.utils.data import get_worker_info

_settled_pid: int | None = None


def settle() -> None:
    """In a DataLoader worker, the first time it is called in that process: `gc.freeze()`.
    Elsewhere (the user's own process) nothing: its garbage collection is the user's."""
    global _settled_pid
    if _settled_pid == os.getpid() or get_worker_info() is None:
        return
    _settled_pid = os.getpid()
    gc.freeze()
