"""One pack at a time into a DEST: a second one refuses at once, naming the first.

Without a lock two packs into one DEST delete each other's temporary files and replace each
other's shards, and one can report success over a dataset it no longer holds. A pack holds
`DEST/.shardkit-lock` for the whole pack (prepare, jobs, commit, cleanup); it notes the
holder's run id, pid, host and start time, which a refused pack names.

A local DEST's lock file is locked with flock(2) (lock_flock.py); on S3, GCS and Azure the
lock is an object held by a lease (lock_lease.py). Other remote stores (WebHDFS, HDFS) are not
locked: run one pack at a time into them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from .. import storage
from ..storage import StorageOptions
from ..storage.stores import store_for
from .lock_flock import let_go, take
from .lock_lease import Holding, Lease

__all__ = ["LEASE_ENV", "LEASE_S", "NAME", "Holding", "held", "lease_s"]

NAME = ".shardkit-lock"  # hidden: both sinks leave DEST's dot files alone
LEASE_S = 120.0  # an object store's lock unrefreshed this long is stale (SHARDKIT_LOCK_LEASE_S)
LEASE_ENV = "SHARDKIT_LOCK_LEASE_S"


@contextlib.contextmanager
def held(dest: str, storage_options: StorageOptions | None = None) -> Iterator[Holding]:
    """Hold DEST's lock for the block (nothing for a remote DEST that offers no conditional
    writes); DestinationBusyError naming the holder where another pack holds it."""
    if storage.is_local(dest):
        path = os.path.join(storage.local_path(dest), NAME)
        fd = take(path, dest)
        try:
            yield Holding()
        finally:
            if fd is not None:
                let_go(fd, path)
        return
    url = storage.join(dest, NAME)
    store = store_for(url, storage_options)
    if not store.conditional_writes:
        yield Holding()
        return
    lease = Lease(store, url, dest, lease_s())
    lease.take()
    try:
        yield lease
    finally:
        lease.release()


def lease_s() -> float:
    """The lease a pack started now holds an object store's lock by (LEASE_S, or the
    environment's SHARDKIT_LOCK_LEASE_S)."""
    text = os.environ.get(LEASE_ENV)
    if text is None:
        return LEASE_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < 1e9:
        raise ValueError(f"the environment variable {LEASE_ENV}={text!r} is not a number of seconds above 0")
    return value
