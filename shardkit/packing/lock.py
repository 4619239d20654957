"""One pack at a time into a DEST: a second one refuses at once, naming the first.

A local DEST holds a lock file, `DEST/.shardkit-lock`, locked with flock(2) for the whole
pack (prepare, jobs, commit, cleanup) and holding the holder's pid, host and start time,
which a refused pack names. Without it two packs into one DEST would delete each other's
temporary files and replace each other's shards, and one could report success over a
dataset it no longer holds.

A pack that is killed (even by SIGKILL, or with its machine) leaves no stale lock: the
kernel drops a process's flock when it dies (on NFS the server does, when the client's lease
ends), so the file it leaves is only a note, and the next pack takes the lock with nothing to
remove. Its pool workers, forked while it was held, keep it until they exit: they may still
be writing. The holder removes the file as it lets go; a pack that opened it just before
checks, once locked, that it still holds the file at that path, else starts again.

A remote DEST (an object store) is not locked: storage offers no create-if-absent
(S3's `If-None-Match: *`, GCS's `ifGenerationMatch=0`) to build one on, and a check then a
put leaves the race open. Run one pack at a time into a bucket's prefix.
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
from collections.abc import Iterator

from .. import storage
from ..errors import DestinationBusyError

NAME = ".shardkit-lock"  # hidden: both sinks leave DEST's dot files alone
log = logging.getLogger("shardkit")


@contextlib.contextmanager
def held(dest: str) -> Iterator[None]:
    """Hold DEST's lock for the block (nothing for a remote DEST); DestinationBusyError
    naming the holder where another pack holds it."""
    if not storage.is_local(dest):
        yield
        return
    path = os.path.join(storage.local_path(dest), NAME)
    fd = _take(path, dest)
    try:
        yield
    finally:
        if fd is not None:
            _let_go(fd, path)


def _take(path: str, dest: str) -> int | None:
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
                raise DestinationBusyError(f"{storage.display(dest)}: another pack is writing into it ({holder}; it "
                                           f"holds {path}): wait for it to end, or pack into another folder") from None
            log.warning("%s: cannot lock %s (%s): another pack into it at the same time would not be refused",
                        storage.display(dest), path, os.strerror(e.errno or 0))
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


def _let_go(fd: int, path: str) -> None:
    """Remove the file, then unlock (for this process and the workers that inherited it)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
