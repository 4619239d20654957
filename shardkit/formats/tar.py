"""WebDataset-compatible tar shards: the header layout, the limits on what a reader takes in,
and the streaming reader (a whole shard, member by member, from its start).

Everything here works on plain binary file objects (never on paths or URLs), so it is
testable on io.BytesIO and storage stays in storage/. Headers are POSIX ustar with every
variable field fixed (mtime 0, uid/gid 0, no user names, mode 0644): the same samples give
the same bytes (tar_writer.py writes them). The reader also understands what other writers
emit: pax extended headers (Python's tarfile default, used by webdataset's ShardWriter), GNU
long names, directories. One sample read out of its byte range is tar_sample.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, overload

from ..errors import CorruptShardError

if TYPE_CHECKING:
    import numpy as np

BLOCK = 512
RECORD = 20 * BLOCK  # GNU tar and Python's tarfile pad archives to 10 KiB records
_SKIP = 1 << 20  # a member whose data is not kept is read past in pieces of this size
MAX_HEADER = 1 << 20
"""The most bytes a pax extended header or a GNU long-name header may hold (checked on its
header block, before its data is read): what a small .tar.gz could inflate to gigabytes."""
MAX_NAME = 4096
"""The most bytes a member's name may take (Linux's PATH_MAX: `tar x` could not make a longer one)."""
_EXTENDED = {b"x": "pax extended header", b"g": "pax global header", b"L": "GNU long name", b"K": "GNU long link name"}

EMPTY_BLOCK = bytes(BLOCK)
_USTAR_MAGIC = b"ustar\x0000"
POSIX_MAGIC, GNU_MAGIC = b"ustar\x00", b"ustar "  # magics of POSIX ustar/pax and of GNU tar's own format


class Readable(Protocol):
    """What the readers need of a file: `read`, in order (a pipe, a hashing wrapper, a socket)."""

    def read(self, n: int = -1, /) -> bytes: ...


def _template() -> bytes:
    """Every header field but name, size and checksum, which `header` fills in."""
    head = bytearray(BLOCK)
    head[100:108] = b"0000644\x00"  # mode
    head[108:116] = b"0000000\x00"  # uid
    head[116:124] = b"0000000\x00"  # gid
    head[136:148] = b"00000000000\x00"  # mtime
    head[148:156] = b" " * 8  # checksum is computed with its own field as spaces
    head[156:157] = b"0"  # regular file
    head[257:265] = _USTAR_MAGIC
    return bytes(head)


_TEMPLATE = _template()
_TEMPLATE_SUM = sum(_TEMPLATE)


def header(name: str, size: int, kind: bytes = b"0") -> bytes:
    """A ustar header (a regular file, or `kind`): deterministic, 512 bytes. A name longer
    than the 100-byte field is cut there: `TarWriter` puts the whole name in a pax header."""
    raw = name.encode("utf-8")[:100]
    if size >= 8**11:
        raise ValueError(f"tar member larger than 8 GiB: {name!r}")
    size_field = b"%011o\x00" % size
    head = bytearray(_TEMPLATE)
    head[0 : len(raw)] = raw
    head[124:136] = size_field
    head[156:157] = kind
    checksum = _TEMPLATE_SUM + sum(raw) + sum(size_field) + kind[0] - ord("0")
    head[148:156] = b"%06o\x00 " % checksum
    return bytes(head)


def padding(size: int) -> int:
    return -size % BLOCK


@overload
def member_size(size: int) -> int: ...
@overload
def member_size(size: np.ndarray) -> np.ndarray: ...
def member_size(size: Any) -> Any:
    """What a member of `size` bytes (or each of an array of sizes) takes in a tar: its
    header, its data, its padding."""
    return BLOCK + size + (-size % BLOCK)


def octal(field: bytes) -> int | None:
    """A header's number: octal digits, maybe space-led, ended by NULs or spaces; GNU's
    base-256 (a first byte 0x80) for sizes of 8 GiB and more. None where it is no such
    number: `int` alone would take a sign (`-7777777777`, a negative size), `_` or spaces."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    digits = field.rstrip(b"\x00 ").lstrip(b" ")
    if not digits:
        return 0
    if not digits.isdigit():  # ASCII digits only, no sign
        return None
    try:
        return int(digits, 8)
    except ValueError:  # an 8 or a 9
        return None


def parse_octal(field: bytes, where: str, what: str = "size") -> int:
    number = octal(field)
    if number is None:
        raise CorruptShardError(
            f"{where}: its {what} field {bytes(field).rstrip(bytes(1))!r} is not a number in octal "
            "digits (a damaged or hostile tar header)"
        )
    return number


def check_extended(kind: bytes, size: int, where: object) -> None:
    """Refuse an extended header (pax, GNU long name) larger than MAX_HEADER before reading it."""
    if kind in _EXTENDED and size > MAX_HEADER:
        raise CorruptShardError(
            f"{where}: a {_EXTENDED[kind]} of {size} bytes, over the limit of {MAX_HEADER} "
            "(formats.tar.MAX_HEADER): a damaged shard or a decompression bomb"
        )


def _check_name(name: str | bytes, where: str) -> None:
    size = len(name.encode("utf-8") if isinstance(name, str) else name)
    if size > MAX_NAME:
        raise CorruptShardError(
            f"{where}: a member name of {size} bytes, over the limit of {MAX_NAME} (formats.tar.MAX_NAME)"
        )


def _check_header(head: bytes, where: str) -> None:
    stored = parse_octal(head[148:156], where, "checksum")
    if stored != sum(head) - sum(head[148:156]) + 8 * 32:  # the field itself counts as spaces
        raise CorruptShardError(f"{where}: tar header checksum mismatch (not a tar file, or corrupt)")


def _pax_path(data: bytes, where: str) -> str | None:
    """The `path` record of a pax extended header, if any ("LEN path=VALUE\\n" records, LEN
    counting the whole record: one that does not end in a newline there is refused)."""
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space]) if data[pos:space].isdigit() else 0
        end = pos + length
        if length <= space - pos + 1 or end > len(data) or data[end - 1 : end] != b"\n":
            raise CorruptShardError(f"{where}: a malformed pax header record at byte {pos} of its data")
        key, _, value = data[space + 1 : end - 1].partition(b"=")
        if key == b"path":
            _check_name(value, where)
            return _utf8(value, where)
        pos = end
    return None


def iter_members(
    f: Readable, where: str, limit: int | None = None, base: int = 0, keep: bool = True
) -> Iterator[tuple[int, int, str, bytes]]:
    """Yield (start, end, name, data) for every regular file from the current position of `f`.

    [start, end) is the member's byte span, pax or long-name headers included, relative to
    the starting position. Without `keep`, a member's data larger than a MB is read past,
    not held (it comes as b""): a scan's memory stays small whatever the members' sizes.

    Stops at the end-of-archive block, at EOF, or after `limit` bytes (a sample range).
    `where` names the shard in error messages, with byte positions counted from `base` (the
    shard's byte at the starting position). A member cut short raises CorruptShardError.
    """
    consumed = 0
    start = 0
    long_name: str | None = None
    while limit is None or consumed < limit:
        head = f.read(BLOCK)
        if not head or head == EMPTY_BLOCK:
            return
        member = f"{where}, member at byte {base + consumed}"
        if len(head) < BLOCK:
            raise CorruptShardError(f"{member}: truncated tar header")
        _check_header(head, member)
        size = parse_octal(head[124:136], member)
        kind = head[156:157]
        check_extended(kind, size, member)
        pad = padding(size)
        got, data = _member_data(f, size, keep or kind in (b"L", b"x"))
        padded = len(f.read(pad)) if pad and got == size else 0
        if got < size or padded < pad:
            cut = long_name or head[:100].split(b"\x00", 1)[0].decode("utf-8", "replace")
            short = f"{got} of {size} bytes" if got < size else f"its padding: {padded} of {pad} bytes"
            raise CorruptShardError(
                f"{where}: member {cut!r} cut off at byte {base + consumed + BLOCK + got + padded} "
                f"({short}): the shard is truncated"
            )
        consumed += BLOCK + size + pad
        if kind == b"L":  # GNU long name for the next member
            _check_name(data.rstrip(b"\x00"), member)
            long_name = _utf8(data.rstrip(b"\x00"), member)
            continue
        if kind == b"x":  # pax extended header for the next member
            long_name = _pax_path(data, member) or long_name
            continue
        if kind == b"g":  # pax global header: nothing we use
            start = consumed
            continue
        name = long_name
        long_name = None
        if name is None:
            name = _utf8(head[:100].split(b"\x00", 1)[0], member)
            prefix = _utf8(head[345:500].split(b"\x00", 1)[0], member)
            if prefix and head[257:263] == POSIX_MAGIC:  # GNU's format keeps other fields there
                name = f"{prefix}/{name}"
        if kind in (b"0", b"\x00", b"7"):  # regular file (and contiguous file)
            yield start, consumed, name, data
        start = consumed


def _member_data(f: Readable, size: int, keep: bool) -> tuple[int, bytes]:
    """(bytes read, up to `size`; the data, or b"" where it is not kept and over `_SKIP`)."""
    if keep or size <= _SKIP:
        data = f.read(size)
        return len(data), data
    got = 0
    while got < size and (piece := f.read(min(_SKIP, size - got))):
        got += len(piece)
    return got, b""


def _utf8(name: bytes, where: str) -> str:
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptShardError(f"{where}: its name {name!r} is not UTF-8 (WebDataset keys are text)") from None


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's rule: KEY.EXT splits at the first dot of the base name."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def iter_samples(
    f: Readable, where: str, limit: int | None = None, base: int = 0
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Group adjacent members with the same key into (key, {ext: bytes}) samples."""
    key: str | None = None
    fields: dict[str, bytes] = {}
    for _, _, name, data in iter_members(f, where, limit, base):
        k, ext = split_name(name)
        if k != key:
            if key is not None and fields:
                yield key, fields
            key, fields = k, {}
        if ext:
            fields[ext] = data
    if key is not None and fields:
        yield key, fields


@dataclass
class Scan:
    """What a full read of a shard learns: sample keys, offsets (plus the end of the last
    sample) and the field names seen."""

    keys: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    fields: set[str] = field(default_factory=set)


def scan(f: Readable, where: str) -> Scan:
    """Scan a shard written by any tool. Reads it once, start to end."""
    out = Scan()
    end = 0
    first: dict[str, set[str]] = {}  # each key's fields, as its first run of members had them
    group: set[str] = set()

    def check(key: str, at: int) -> None:
        """A key met again must come whole again (concatenated or repeated samples are
        fine); in parts, it is a sample whose files are apart, which webdataset would
        silently read as two half samples."""
        if first.setdefault(key, group) != group:
            raise CorruptShardError(
                f"{where}: the members of sample {key!r} are not adjacent (more of them at byte {at}): a sample's "
                "files must follow each other in the tar (`tar --sort=name` does that)"
            )

    for start, stop, name, _ in iter_members(f, where, keep=False):
        key, ext = split_name(name)
        if not out.keys or out.keys[-1] != key:
            if out.keys:
                check(out.keys[-1], out.offsets[-1])
            group = set()
            out.keys.append(key)
            out.offsets.append(start)
        group.add(ext)
        out.fields.add(ext)
        end = stop
    if out.keys:
        check(out.keys[-1], out.offsets[-1])
    out.offsets.append(end)
    return out
