"""A shard's fingerprint: the pin of a file whose store records no version (local disk).

An object store changes a mark of its own when an object is replaced (S3's ETag, GCS's
generation), and that mark is what the index records. A local file has only its
modification time and inode, and both change with every plain copy (`cp -r`, `rsync`
without `-t`, a restore from a backup): a pin on them would fail every read of a good copy.
So a local shard is pinned by what tells one shard from another, cheaply: its size and a
hash of its first `HEAD` bytes, one read at pack time and one when a reader first opens the
shard. A tar shard's first block is its first member's header: that sample's key, the
member's size and mode. Another shard's bytes, a shard re-packed from other input, one grown
or cut short, differ there (a shard cut short whose head is unchanged is not "replaced": the
reader says where it ends and keeps the samples before the cut).

What it does not see is a change inside a shard's samples (a flipped bit, an image
rewritten in place): that is bad data, named and skipped sample by sample as on_error says,
and what `verify=True` (the whole shard's sha256) finds. The fingerprint depends on the
bytes alone, so two packs of the same input still write the same index.json.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

HEAD = 512  # bytes read at a shard's start: one tar block
MARK = "fingerprint"  # the key of the pin, in index.json's "version" of a shard

Read = Callable[[int, int], bytes]  # read(start, stop): a file's bytes [start, stop), fewer at its end


def _hash(head: bytes) -> str:
    return hashlib.sha256(b"shardkit fingerprint 1\0" + head).hexdigest()[:32]


def fingerprint(size: int, read: Read) -> str:
    """The fingerprint of a file of `size` bytes: "SIZE:HASH", HASH that of its first bytes."""
    return f"{size}:{_hash(read(0, min(HEAD, size)) if size else b'')}"


def mismatch(expected: str, size: int, read: Read) -> str | None:
    """Why a file of `size` bytes now is not the one fingerprinted `expected`, or None where it
    is, or where it is that file cut short (its head unchanged, or too short to tell), which
    the reader's own checks report precisely (where it ends), sample by sample."""
    was, _, head = expected.partition(":")
    if not was.isdigit() or not head:
        return f"the index's fingerprint {expected!r} is not one this shardkit writes"
    if size > int(was):
        return f"{size} bytes, the index has {was}"
    if size < int(was) and size < HEAD:
        return None  # cut short before its first block ends: the reads say where
    if _hash(read(0, min(HEAD, int(was)))) == head:
        return None
    said = "" if size == int(was) else f"{size} bytes, the index has {was}, and "
    return f"{said}its first {HEAD} bytes are not the index's"


def read_descriptor(fd: int) -> Read:
    return lambda start, stop: os.pread(fd, stop - start, start)


def of_path(path: str) -> str:
    """The fingerprint of the local file at `path`."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return fingerprint(os.fstat(fd).st_size, read_descriptor(fd))
    finally:
        os.close(fd)
