"""What a process forked from one that reads shards does first: freeze what it inherited.

A forked DataLoader worker starts with every object of the main process, torch's hundreds of
thousands included. Python's full garbage collection walks all of them and writes to each
one's header, so the worker's first full collection copies every page of them from its
parent (copy-on-write): 100-140 ms here, in the middle of the first batch. When that
collection comes depends on the parent's collection counters at the fork, so it came and
went with unrelated changes to the main process, and it could come before any code of ours
ran in the worker. `gc.freeze()` right after the fork moves what the child inherited to the
permanent generation, so its collections only ever walk what the child itself makes: the
recipe CPython's documentation gives for fork without exec.

Importing shardkit's readers registers it for every process forked afterwards (DataLoader
workers, and any other fork of the process): such a child never collects what it inherited,
which lives as long as the child anyway. The process that forks is left as it is.
"""

from __future__ import annotations

import gc
import os

os.register_at_fork(after_in_child=gc.freeze)
