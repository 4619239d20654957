"""Clients whose runtime does not survive a fork: obstore's (one tokio runtime a process).
Checked with obstore 0.12: a DataLoader worker forked from a process that had read through
obstore hangs at its own first request (s3torchconnector's CRT client, measured and dropped,
was killed by SIGSEGV in 4 of 6 runs the same way). So the main process never starts it
(stores/choice.py), and `starting` makes a child of a process that has refuse to, in a line,
rather than hang or crash.
"""

from __future__ import annotations

import os

from ...errors import ShardkitError
from ..urls import display

_started: dict[str, int] = {}  # client -> the process that started its runtime (a forked child inherits it)


def starting(client: str, url: str) -> None:
    """Before this process's first request through `client`: fail, naming `url`, where its
    runtime was started by the process this one was forked from."""
    pid = os.getpid()
    if _started.setdefault(client, pid) != pid:
        raise ShardkitError(
            f"{display(url)}: storage option client={client!r}: this process was forked from one that "
            f"had already read through {client}, whose runtime does not survive a fork; read in "
            "DataLoader workers only, or use multiprocessing_context='spawn' or 'forkserver'"
        )
