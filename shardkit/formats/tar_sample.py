"""One sample of a tar shard read out of its byte range (the index's offsets), by `read_at`
calls or from bytes in memory: the fast path for plain ustar members, the streaming reader
(tar.py) for anything else."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable

from ..errors import CorruptShardError
from .tar import BLOCK, EMPTY_BLOCK, GNU_MAGIC, POSIX_MAGIC, check_extended, iter_samples, octal, padding, parse_octal

# name, size (11 octal digits), type flag, magic and (POSIX ustar) name prefix of a header, in one call
_FIELDS = struct.Struct("100s24x11s21xc100x6s82x155s")  # prefix: bytes 345-500
_REGULAR = (b"0", b"\x00")
_HEAD = 4 * BLOCK  # a sample's first read: its first headers and small members, in one call

ReadAt = Callable[[int, int], bytes]
"""`read_at(size, offset) -> bytes`, os.pread's order: fewer bytes only where the shard ends."""


def read_sample(read_at: ReadAt, start: int, stop: int, where: object) -> tuple[str, dict[str, bytes]]:
    """The one sample in bytes [start, stop) of a shard (its range from the index).

    Small members come out of one read of the sample's first `_HEAD` bytes (or the next
    headers'); a member that does not fit is read on its own, straight into its bytes
    object: every image byte is copied once, from the page cache to the sample.

    `where` names the sample in error messages: a string, or any object whose str() does
    (built only when an error is raised: this runs once per sample).

    The fast path covers plain ustar members, which is all shardkit writes; anything else
    (pax or GNU long-name headers) goes through the general reader. Header checksums are
    left to `verify` (the shard's sha256 covers them): here the ustar magic, the member
    sizes against the range and one key per range catch an index that does not match.
    """
    key: str | None = None
    fields: dict[str, bytes] = {}
    unpack = _FIELDS.unpack_from
    pos = at = start  # next header; where `buf` begins
    buf = b""
    while pos + BLOCK <= stop:
        h = pos - at
        if h + BLOCK > len(buf):
            want = min(_HEAD, stop - pos)
            buf, at, h = read_at(want, pos), pos, 0
            if len(buf) < want:  # the shard ends before this sample does
                raise _cut_off(where, pos, len(buf), _member_cut(buf))
        name, size_field, kind, magic, prefix = unpack(buf, h)
        if kind not in _REGULAR or (magic != POSIX_MAGIC and magic != GNU_MAGIC):
            if buf[h : h + BLOCK] == EMPTY_BLOCK:
                break
            check_extended(kind, octal(buf[h + 124 : h + 136]) or 0, where)  # before reading the range
            return _parse_general(_read_exactly(read_at, start, stop, where), where, start)
        size = _member_size(size_field, buf[h + 124 : h + 136], where)
        begin = pos + BLOCK
        pos = begin + size
        if pos > stop:
            raise CorruptShardError(
                f"{where}: the member at byte {begin - BLOCK - start} of the sample runs past the sample's end"
            )
        text = _member_name(name, prefix if magic == POSIX_MAGIC else b"", where, begin - BLOCK - start)
        dot = text.find(".", text.rfind("/") + 1)  # split_name, inlined
        k, ext = (text, "") if dot < 0 else (text[:dot], text[dot + 1 :])
        if key is None:
            key = k
        elif k != key:
            raise CorruptShardError(f"{where}: members of two samples ({key!r}, {k!r}) in one sample's range")
        if pos - at <= len(buf):
            fields[ext] = buf[begin - at : pos - at]
        else:
            fields[ext] = _read_exactly(read_at, begin, pos, where, text)
        pos += -size % BLOCK
    if key is None:
        raise CorruptShardError(f"{where}: no tar member in the sample's byte range")
    return key, fields


def _member_size(digits: bytes, field: bytes, where: object) -> int:
    """A ustar header's member size: plain octal digits at once, anything else (spaces, NULs,
    base-256) by the general parser, which names a bad field."""
    try:
        if not digits.isdigit():  # `int` would take a sign: a negative size
            raise ValueError
        return int(digits, 8)
    except ValueError:
        return parse_octal(field, str(where))


def _member_name(name: bytes, prefix: bytes, where: object, offset: int) -> str:
    """A ustar header's member name, its `prefix` (a long path's folders) joined in front."""
    try:
        text = name.split(b"\x00", 1)[0].decode("utf-8")
        if prefix[:1] not in (b"", b"\x00"):
            text = prefix.split(b"\x00", 1)[0].decode("utf-8") + "/" + text
    except UnicodeDecodeError:
        raise CorruptShardError(
            f"{where}: the member at byte {offset} of the sample has a name "
            f"that is not UTF-8 ({name.rstrip(bytes(1))!r})"
        ) from None
    return text


def buffer_reader(buf: bytes | memoryview, base: int = 0) -> ReadAt:
    """`read_at` over bytes [base, base + len(buf)) of a shard, held in memory."""
    view = memoryview(buf)
    return lambda size, offset: view[offset - base : offset - base + size].tobytes()


def parse_sample(buf: bytes | memoryview, where: object, base: int = 0) -> tuple[str, dict[str, bytes]]:
    """`read_sample` over a sample's bytes already in memory, bytes [base, base + len(buf))
    of its shard."""
    return read_sample(buffer_reader(buf, base), base, base + len(buf), where)


def _read_exactly(read_at: ReadAt, start: int, stop: int, where: object, member: str | None = None) -> bytes:
    data = read_at(stop - start, start)
    if len(data) < stop - start:
        raise _cut_off(where, start, len(data), member)
    return data


def _member_cut(buf: bytes) -> str | None:
    """The name of the member whose bytes a short read `buf` (from a header on) ends in."""
    h = 0
    while h + BLOCK <= len(buf):
        name, size_field, _, _, _ = _FIELDS.unpack_from(buf, h)
        size = octal(size_field)
        if size is None:
            return None
        if h + BLOCK + size > len(buf):
            return bytes(name).split(b"\x00", 1)[0].decode("utf-8", "replace")
        h += BLOCK + size + padding(size)
    return None


def _cut_off(where: object, offset: int, got: int, member: str | None = None) -> CorruptShardError:
    """A read at `offset` (of `member`, where known) that got only `got` bytes: the shard
    ends there (or before, if none)."""
    end = f"at byte {offset + got}" if got else f"at or before byte {offset}"
    named = f" in member {member!r}" if member is not None else ""
    return CorruptShardError(f"{where}: cut off{named}, the shard ends {end} (truncated or replaced)")


def _parse_general(buf: bytes, where: object, base: int) -> tuple[str, dict[str, bytes]]:
    samples = list(iter_samples(io.BytesIO(buf), str(where), base=base))
    if len(samples) != 1:
        raise CorruptShardError(f"{where}: {len(samples)} samples in one sample's byte range")
    return samples[0]
