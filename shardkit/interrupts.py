"""Ctrl-C for the `shardkit` command: the first stops it cleanly, a second exits at once.

Its own module (no click, no shardkit imports) because it is process-wide signal state: only
the command's entry point (`cli.run`) installs it, never `main` called in a user's process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

INTERRUPTED_AGAIN = b"\ninterrupted again: exiting now (a rerun of pack resumes)\n"


def exit_on_second_ctrl_c() -> None:
    """For the life of this process: the first Ctrl-C raises KeyboardInterrupt and the command
    stops cleanly (a pack waits for its jobs in flight to reach their next image, which a
    stalled remote read puts off by up to a minute); a second one exits at once with 130, as
    a kill would (pool workers die with the process on Linux; a pack resumes on a rerun).
    Processes forked from this one keep Python's behaviour. Not where Ctrl-C is ignored (a
    background job) or handled by someone else."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        return
    owner, pressed = os.getpid(), False

    def on_ctrl_c(signum: int, frame: Any) -> None:
        nonlocal pressed
        if pressed and os.getpid() == owner:
            with contextlib.suppress(OSError):  # stderr gone: `| tee` ended by the first Ctrl-C
                os.write(2, INTERRUPTED_AGAIN)
            os._exit(130)
        pressed = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
