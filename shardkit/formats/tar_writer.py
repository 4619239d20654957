"""The tar shards shardkit writes: adjacent `KEY.EXT` members with deterministic headers
(tar.header), hashed as they go out, each sample's offset recorded."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import BinaryIO

from . import tar
from .tar import BLOCK, EMPTY_BLOCK, RECORD, header, padding


def _pax_record(name: str) -> bytes:
    """A pax extended header's body carrying `name` as the next member's path:
    "LEN path=NAME\n", where LEN counts the whole record, its own digits included."""
    body = f" path={name}\n".encode("utf-8")
    length = len(body) + len(str(len(body)))
    length = len(body) + len(str(length))  # one more digit, when adding the digits made one
    return str(length).encode() + body


def check_key(key: str) -> None:
    """A sample key as WebDataset reads it back: the part of a member's path before the
    first dot of its base name. So no dot in the base name; folders are allowed (`train/0001`)
    but not absolute paths or `..`, which would escape a folder when a shard is extracted."""
    base = key.rpartition("/")[2]
    if not base or "." in base or key.startswith("/") or ".." in key.split("/"):
        raise ValueError(
            f"sample key must have a non-empty base name with no '.', and no '/' at the start or '..' part: {key!r}"
        )


class TarWriter:
    """Writes samples as adjacent `KEY.EXT` members and hashes the bytes as they go out.

    `offsets` holds the byte offset of every sample's first header plus the end of the
    last sample, so a reader can fetch sample i as bytes [offsets[i], offsets[i+1]).
    """

    def __init__(self, fileobj: BinaryIO):
        self._f = fileobj
        self._sha = hashlib.sha256()
        self.offsets: list[int] = [0]
        self.size = 0

    def _write(self, data: bytes) -> None:
        self._f.write(data)
        self._sha.update(data)
        self.size += len(data)

    def write(self, key: str, fields: Mapping[str, bytes]) -> None:
        """Add one sample; fields are written in sorted order of their extension."""
        check_key(key)
        for ext in sorted(fields):
            data = fields[ext]
            name = f"{key}.{ext}" if ext else key  # a member without extension (LICENSE) keeps its name
            length = len(name.encode("utf-8"))
            if length > tar.MAX_NAME:  # what a reader would refuse (read at each call: a caller may raise it)
                raise ValueError(
                    f"tar member name of {length} bytes, over {tar.MAX_NAME} (tar.MAX_NAME): {name[:60]!r}..."
                )
            if length > 100:  # too long for ustar: a pax header names it
                record = _pax_record(name)
                self._member(header("././@PaxHeader", len(record), b"x"), record)
            self._member(header(name, len(data)), data)
        self.offsets.append(self.size)

    def _member(self, head: bytes, data: bytes) -> None:
        self._write(head)
        self._write(data)
        pad = padding(len(data))
        if pad:
            self._write(EMPTY_BLOCK[:pad])

    def close(self) -> str:
        """Write the end-of-archive blocks and record padding; return the sha256 hex digest."""
        end = self.size + 2 * BLOCK
        self._write(bytes(2 * BLOCK + (-end % RECORD)))
        return self._sha.hexdigest()
