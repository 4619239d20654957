"""A shard's fingerprint: the pin of a file whose store records no version (local disk).

An object store changes a mark of its own when an object is replaced (S3's ETag, GCS's
generation), and that mark is what the index records. A local file has only its
modification time and inode, and both change with every plain copy (`cp -r`, `rsync`
without `-t`, a restore from a backup): a pin on them would fail every read of a good copy.
So a local shard is pinned by its contents instead, cheaply: a hash of its size and of its
first and last `ENDS` bytes, two reads of 64 KiB at pack time and again when a reader first
opens the shard. Another shard's bytes, a shard re-packed from other input or with other
options, one cut short or grown, all differ there: a tar shard begins with its first
sample's member names and ends with its last sample's bytes. A change confined to the
middle of a big shard (a flipped bit) is not seen: that is what `verify=True` (the whole
shard's sha256) is for. The fingerprint depends on the bytes alone, so two packs of the same
input still write the same index.json.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

ENDS = 64 << 10  # bytes read at each end of a shard
MARK = "fingerprint"  # the key of the pin, in index.json's "version" of a shard


def ranges(size: int) -> list[tuple[int, int]]:
    """The byte ranges a fingerprint reads: the head, and the tail where it is another range
    (none of an empty file)."""
    head, tail = (0, min(ENDS, size)), (max(ENDS, size - ENDS), size)
    return [r for r in (head, tail) if r[0] < r[1]]


def fingerprint(size: int, read: Callable[[int, int], bytes]) -> str:
    """The fingerprint of a file of `size` bytes, its ranges read by `read(start, stop)`."""
    h = hashlib.sha256(b"shardkit fingerprint 1\0%d\0" % size)
    for start, stop in ranges(size):
        data = read(start, stop)
        if len(data) != stop - start:  # shrunk while read: a fingerprint no index holds
            h.update(b"\0short")
        h.update(data)
    return h.hexdigest()[:32]


def of_descriptor(fd: int) -> str:
    """The fingerprint of the open local file `fd`."""
    return fingerprint(os.fstat(fd).st_size, lambda start, stop: os.pread(fd, stop - start, start))


def of_path(path: str) -> str:
    """The fingerprint of the local file at `path`."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return of_descriptor(fd)
    finally:
        os.close(fd)
