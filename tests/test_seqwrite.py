"""The local shard writer: direct I/O from aligned buffers, with a page-cache fallback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardkit.storage.seqwrite import ALIGN, CHUNK, SequentialWriter


@pytest.mark.parametrize(
    "sizes", [[], [1], [ALIGN - 1, 1], [ALIGN], [512] * 9000, [CHUNK + 1], [3 * CHUNK + 77, 5, CHUNK]]
)
def test_writes_exactly_the_bytes(tmp_path: Path, sizes: list[int]) -> None:
    pieces = [os.urandom(n) for n in sizes]
    with SequentialWriter(str(tmp_path / "f")) as f:
        for piece in pieces:
            assert f.write(piece) == len(piece)
        f.write(memoryview(b"tail"))
        f.finish()
    assert (tmp_path / "f").read_bytes() == b"".join(pieces) + b"tail"


def test_falls_back_and_reports_write_errors() -> None:
    """/dev/full refuses O_DIRECT at open (fallback) and every write with ENOSPC (reported)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(OSError) as err, SequentialWriter("/dev/full") as f:
        f.write(b"x" * (2 * CHUNK + 10))
        f.finish()
    assert err.value.errno == 28  # ENOSPC
