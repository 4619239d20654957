"""Storage: the package that talks to local disks and object stores. Local paths take a
direct os path (fast, no fsspec overhead); everything else goes through fsspec (imported in
clients.py only) with the caller's storage options passed through unchanged.

    urls          which URL is local, joining, display (no secrets)
    clients       fsspec filesystems, one per process, protocol and options
    patience      shardkit's own options: a request's timeout and attempts
    retry         the retry policy: transient or permanent, backoff, one-line errors
    latencies     the first-byte latencies a process has seen, for hedges
    files         one-shot operations: read, list, size, version, remove
    atomic        writes a reader never sees half of
    range_reader  a worker's ranged reads of its shards, cache, checksums and versions
    streams       stream-through reads: a range readable while its bytes arrive
"""

from .atomic import TMP_MARK, atomic_writer, write_bytes_atomic
from .clients import endpoint, filesystem
from .fetch import opening_counts
from .files import (
    exists,
    find,
    listdir,
    makedirs,
    open_read,
    pin_now,
    pins,
    read_bytes,
    read_hedged,
    read_range,
    remove,
    remove_dir,
    size,
    version,
)
from .range_reader import RangeReader
from .patience import RETRIES, TIMEOUT_S, patience_for
from .retry import retrying, stop_when
from .stores.s3 import share_uploads
from .urls import StorageOptions, display, is_local, join, local_path

__all__ = [
    "RETRIES",
    "TIMEOUT_S",
    "TMP_MARK",
    "RangeReader",
    "StorageOptions",
    "atomic_writer",
    "display",
    "endpoint",
    "exists",
    "filesystem",
    "find",
    "is_local",
    "join",
    "listdir",
    "local_path",
    "makedirs",
    "pin_now",
    "pins",
    "open_read",
    "patience_for",
    "read_bytes",
    "read_hedged",
    "read_range",
    "remove",
    "remove_dir",
    "retrying",
    "share_uploads",
    "size",
    "opening_counts",
    "stop_when",
    "version",
    "write_bytes_atomic",
]
