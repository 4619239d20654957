"""gzip: compressed tar shards (`.tar.gz`, `.tgz`, or any name: told by their first bytes)
and compressed members (`x.json.gz`), read as streams.

A gzip stream has no random access: byte N of the tar inside is known only once every byte
before it has been inflated. So a compressed shard is read from its start. `Inflater` is
that forward read, over any `read(n)`; `Ranges` serves byte ranges of the tar inside from
one forward pass, keeping the last `keep` bytes it inflated so that ranges asked for a
little out of order (a shuffle window) need no second pass; a range further back starts
the pass again (`passes` counts them).

Like the tar reader, nothing here opens a file: it reads through the functions it is given
(`read(n)`; `fetch(offset, size)` on the compressed file, fewer bytes only at its end).

Decompression bombs: every call inflates at most what was asked for, a `.gz` member's
inflated size is capped (`gunzip`, `inflate_fields`), and a scan reads past large members
without holding them; the readers check a compressed shard's sample sizes (from its index)
against the same cap before they inflate one.
"""

from __future__ import annotations

import bisect
import threading
import zlib
from collections.abc import Callable
from typing import Any

from ..errors import CorruptShardError
from .tar import Readable

MAGIC = b"\x1f\x8b\x08"  # gzip's magic and its one compression method, deflate
MAX_MEMBER = 1 << 30  # the default cap on what one member (or sample) of a compressed shard inflates to
_GZIP = 16 + zlib.MAX_WBITS  # zlib parses (and checks the CRC of) gzip's header and trailer
_PIECE = 1 << 20  # what one inflate call returns at most, when the caller asks for "some"

Read = Callable[[int], bytes]
Fetch = Callable[[int, int], bytes]
"""`fetch(offset, size) -> bytes` on the compressed file: fewer bytes only where it ends."""


def is_gzip(head: bytes) -> bool:
    """Whether a file starting with `head` (3 bytes or more) is gzip. A tar never starts so:
    its first bytes are a member's name."""
    return head[:3] == MAGIC


class Inflater:
    """The inflated bytes of a gzip stream (one member or several back to back, as `gzip`
    and `cat a.gz b.gz` make; zero padding after the last is ignored), read in order.

    `read(n)` as a file's. A stream that is not gzip, damaged (zlib checks each member's
    CRC and length) or cut short raises CorruptShardError naming `where`.
    """

    def __init__(self, read: Read, where: str, chunk: int = 1 << 20):
        self._read, self._where, self._chunk = read, where, chunk
        self._inflate: zlib._Decompress | None = None  # None between members
        self._input = b""  # compressed bytes read and not yet inflated
        self._members = 0
        self.consumed = 0  # compressed bytes taken from `read`
        self.position = 0  # inflated bytes handed out

    def read(self, n: int = -1) -> bytes:
        out, got = [], 0
        while n < 0 or got < n:
            piece = self._some(n - got if n >= 0 else _PIECE)
            if not piece:
                break
            out.append(piece)
            got += len(piece)
        data = out[0] if len(out) == 1 else b"".join(out)
        self.position += len(data)
        return data

    def _more(self) -> bytes:
        data = self._read(self._chunk)
        self.consumed += len(data)
        return data

    def _some(self, most: int) -> bytes:
        """Between 1 and `most` inflated bytes; b"" at the end of the stream."""
        while True:
            if self._inflate is None and not self._next_member():
                return b""
            assert self._inflate is not None
            if not self._input:
                self._input = self._more()
                if not self._input:
                    raise CorruptShardError(
                        f"{self._where}: cut off inside its gzip stream, which ends at byte {self.consumed} (truncated)"
                    )
            try:
                out = self._inflate.decompress(self._input, most)
            except zlib.error as e:
                raise CorruptShardError(
                    f"{self._where}: damaged gzip data (before byte {self.consumed}: {e})"
                ) from None
            if self._inflate.eof:
                self._input, self._inflate = self._inflate.unused_data, None
            else:
                self._input = self._inflate.unconsumed_tail
            if out:
                return out

    def _next_member(self) -> bool:
        """Start the next member; False at the end of the stream (what follows the last
        member may only be zeros)."""
        while True:
            data = self._input.lstrip(b"\0")
            if len(data) >= len(MAGIC):
                break
            more = self._more()
            if not more:
                if data:
                    break
                if not self._members:
                    raise CorruptShardError(f"{self._where}: an empty gzip stream")
                return False
            self._input = data + more
        if not is_gzip(data):
            what = "not gzip data" if not self._members else "data after its gzip stream that is not gzip"
            raise CorruptShardError(f"{self._where}: {what} (at byte {self.consumed - len(data)}: {data[:8]!r})")
        self._input, self._inflate = data, zlib.decompressobj(_GZIP)
        self._members += 1
        return True


class _Prefixed:
    """A file object's bytes, with the bytes already read from it put back in front."""

    def __init__(self, head: bytes, f: Readable):
        self._head, self._f = head, f

    def read(self, n: int = -1) -> bytes:
        if not self._head:
            return self._f.read(n)
        if n < 0:
            data, self._head = self._head + self._f.read(), b""
            return data
        data, self._head = self._head[:n], self._head[n:]
        return data + self._f.read(n - len(data)) if len(data) < n else data


def open_stream(f: Readable, where: str) -> tuple[Readable, bool]:
    """(a file object of the tar in `f`, whether it was compressed): `f`'s bytes as they
    are, or inflated where they start as gzip does. Reads `f` in order, never seeks."""
    head = f.read(len(MAGIC))
    if is_gzip(head):
        return Inflater(_Prefixed(head, f).read, where), True
    return _Prefixed(head, f), False


def gunzip(data: bytes, limit: int, where: str) -> bytes:
    """A `.gz` member's bytes inflated: at most `limit` bytes of them, or CorruptShardError.
    A decompression bomb is refused at once where its gzip trailer gives its size away, else
    as soon as it passes `limit`: inflated a piece at a time, never more than `limit` bytes
    held (one read of `limit` bytes would hold them twice, zlib's pieces and their join)."""
    claimed = int.from_bytes(data[-4:], "little") if len(data) >= 18 and is_gzip(data) else 0
    if claimed > limit:  # the last member's size, mod 2**32: at least that many bytes
        raise _too_large(where, limit, f"; its gzip trailer says {claimed}")
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        pos += n
        return data[pos - n : pos]

    stream = Inflater(read, where, chunk=len(data) or 1)
    pieces, got = [], 0
    while piece := stream.read(min(_PIECE, limit + 1 - got)):
        got += len(piece)
        if got > limit:
            raise _too_large(where, limit)
        pieces.append(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _too_large(where: str, limit: int, said: str = "") -> CorruptShardError:
    return CorruptShardError(
        f"{where}: inflates to more than {limit} bytes (max_member_size{said}): a decompression "
        "bomb, or raise the limit"
    )


def is_gzip_field(field: str) -> bool:
    """A member webdataset inflates: `json.gz`, or a bare `gz`."""
    return field.lower().endswith(".gz") or field.lower() == "gz"


def inflate_fields(sample: dict[str, Any], limit: int) -> None:
    """Inflate the `.gz` fields of a sample dict (`__key__`, `__url__`, fields) in place,
    keeping their names as webdataset does, each capped at `limit` bytes."""
    for field, value in sample.items():
        if isinstance(value, bytes) and is_gzip_field(field):
            sample[field] = gunzip(value, limit, f"{sample['__url__']}: sample {sample['__key__']}: field {field!r}")


class Ranges:
    """Byte ranges [start, stop) of the tar inside a gzip file, read through `fetch` in
    `chunk`-sized reads. Thread-safe (reads take turns).

    Ranges asked for in order cost one pass over the file, however they are cut. The last
    `keep` inflated bytes are kept, so a range up to `keep` bytes behind the furthest one
    read is served from memory; one further back costs a new pass from the start.
    """

    def __init__(self, fetch: Fetch, where: str, keep: int, chunk: int = 8 << 20):
        self._fetch, self._where, self._keep, self._chunk = fetch, where, keep, chunk
        self._lock = threading.Lock()
        self.passes = 0  # how many times the stream was started
        self._restart()

    def _restart(self) -> None:
        at = 0

        def read(n: int) -> bytes:
            nonlocal at
            data = self._fetch(at, n)
            at += len(data)
            return data

        self._stream = Inflater(read, self._where, self._chunk)
        self._starts: list[int] = []  # kept pieces of the inflated stream, back to back,
        self._pieces: list[bytes] = []  # ending where the stream is now
        self._kept = 0
        self.passes += 1

    def read(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the tar; fewer where it ends before `stop`."""
        with self._lock:
            first = self._starts[0] if self._starts else self._stream.position
            if start < first:
                self._restart()
            end = self._stream.position
            while end < stop:
                piece = self._stream.read(_PIECE)
                if not piece:
                    break
                if end + len(piece) <= start - self._keep:  # more than `keep` behind the range: not kept,
                    self._starts, self._pieces, self._kept = [], [], 0  # and nothing before it either
                    end += len(piece)
                    continue
                self._starts.append(end)
                self._pieces.append(piece)
                self._kept += len(piece)
                end += len(piece)
            data = self._slice(start, stop)
            self._trim()
            return data

    def _slice(self, start: int, stop: int) -> bytes:
        if not self._starts or stop <= start:
            return b""
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        out = []
        while i < len(self._pieces) and self._starts[i] < stop:
            base, piece = self._starts[i], self._pieces[i]
            out.append(piece[max(0, start - base) : stop - base])
            i += 1
        return out[0] if len(out) == 1 else b"".join(out)

    def _trim(self) -> None:
        """Drop the oldest pieces while the rest still hold `keep` bytes."""
        drop = 0
        while drop < len(self._pieces) - 1 and self._kept - len(self._pieces[drop]) >= self._keep:
            self._kept -= len(self._pieces[drop])
            drop += 1
        if drop:
            del self._starts[:drop], self._pieces[:drop]
