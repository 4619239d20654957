"""A local DEST's lock: its lock file, locked with flock(2).

A pack that is killed (even by SIGKILL, or with its machine) leaves no stale lock: the
kernel drops a process's flock when it dies (on NFS the server does, when the client's lease
ends), so the file it leaves is only a note, and the next pack takes the lock with nothing
to remove. Its pool workers, forked while it was held, keep it until they exit: they may
still be writing. The holder removes the file as it lets go; a pack that opened it just
before checks, once locked, that it still holds the file at that path, else starts again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time

from .. import storage
from ..errors import DestinationBusyError

log = logging.getLogger("shardkit")


def take(path: str, dest: str) -> int | None:
    """The lock file's descriptor, locked and holding this pack's note (None: the file
    system has no locks, and the pack goes on unlocked)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _note(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DestinationBusyError(
                    f"{storage.display(dest)}: another pack is writing into it ({holder}; it "
                    f"holds {path}): wait for it to end, or pack into another folder"
                ) from None
            log.warning(
                "%s: cannot lock %s (%s): another pack into it at the same time would not be refused",
                storage.display(dest),
                path,
                os.strerror(e.errno or 0),
            )
            return None
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it between our open and our lock: open the one there now
    note = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(note).encode() + b"\n", 0)
    return fd


def _same_file(fd: int, path: str) -> bool:
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (found.st_dev, found.st_ino)


def _note(fd: int) -> str:
    """Who holds the lock, from its file: "pid 12 on host h, since ..."."""
    try:
        note = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(note['pid'])} on {note['host']}, since {note['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder has not written its name yet"


def let_go(fd: int, path: str) -> None:
    """Remove the file, then unlock (for this process and the workers that inherited it)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
