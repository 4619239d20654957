"""formats/gzip.py: inflating compressed shards and members as streams, on bytes in memory."""

from __future__ import annotations

import gzip
import io
import os

import pytest

from shardkit.errors import CorruptShardError
from shardkit.formats.gzip import Inflater, Ranges, gunzip, is_gzip, open_stream

DATA = os.urandom(300_000) + bytes(200_000) + b"tar " * 50_000  # incompressible, then compressible


def _reader(buf: bytes, step: int | None = None):
    f = io.BytesIO(buf)
    return (lambda n: f.read(min(n, step))) if step else f.read


def _fetch(buf: bytes, log: list[int] | None = None):
    def fetch(offset: int, size: int) -> bytes:
        if log is not None:
            log.append(offset)
        return buf[offset : offset + size]

    return fetch


@pytest.mark.parametrize(("step", "n"), [(None, 1 << 20), (None, 512), (7, 1), (7, 511), (4096, 512), (1, 1 << 20)])
def test_inflater_reads_what_gzip_wrote_in_any_pieces(step: int | None, n: int) -> None:
    stream = Inflater(_reader(gzip.compress(DATA), step), "x.tgz", chunk=step or 1 << 20)
    out = bytearray()
    while piece := stream.read(n):
        assert len(piece) <= n
        out += piece
    assert bytes(out) == DATA
    assert stream.position == len(DATA)
    assert stream.read(5) == b""


def test_inflater_reads_members_back_to_back_and_ignores_zero_padding() -> None:
    parts = [DATA[:1000], DATA[1000:200_000], DATA[200_000:]]
    buf = b"".join(gzip.compress(p) for p in parts) + bytes(3000)  # `cat a.gz b.gz c.gz`, padded to a block
    assert Inflater(_reader(buf, 100), "x", chunk=100).read() == DATA


def test_inflater_names_bad_streams() -> None:
    packed = gzip.compress(DATA)
    with pytest.raises(CorruptShardError, match=r"^x.tgz: cut off inside its gzip stream, which ends at byte 1000 "):
        Inflater(_reader(packed[:1000]), "x.tgz").read()
    damaged = bytearray(packed)
    damaged[len(packed) // 2] ^= 0xFF
    with pytest.raises(CorruptShardError, match=r"^x.tgz: damaged gzip data"):
        Inflater(_reader(bytes(damaged)), "x.tgz").read()
    with pytest.raises(CorruptShardError, match=r"^x.tgz: not gzip data \(at byte 0: b'hello'\)"):
        Inflater(_reader(b"hello"), "x.tgz").read()
    with pytest.raises(CorruptShardError, match=r"^x.tgz: data after its gzip stream that is not gzip"):
        Inflater(_reader(packed + b"junk"), "x.tgz").read()
    with pytest.raises(CorruptShardError, match=r"^x.tgz: an empty gzip stream"):
        Inflater(_reader(b""), "x.tgz").read()


def test_crc_is_checked() -> None:
    packed = bytearray(gzip.compress(b"hello world"))
    packed[-8] ^= 1  # the CRC32 in the trailer
    with pytest.raises(CorruptShardError, match="damaged gzip data"):
        Inflater(_reader(bytes(packed)), "x").read()


def test_open_stream_tells_gzip_by_its_first_bytes() -> None:
    f, compressed = open_stream(io.BytesIO(gzip.compress(DATA)), "shard.tar")
    assert compressed and f.read() == DATA
    f, compressed = open_stream(io.BytesIO(DATA), "shard.tar.gz")
    assert not compressed and f.read(1) == DATA[:1] and f.read(100_000) == DATA[1:100_001]
    assert f.read() == DATA[100_001:]
    assert is_gzip(gzip.compress(b"")) and not is_gzip(b"\x1f\x8b") and not is_gzip(b"shard/0001.jpg")


def test_gunzip_caps_the_inflated_size() -> None:
    assert gunzip(gzip.compress(DATA), len(DATA), "f") == DATA
    bomb = gzip.compress(bytes(50 << 20))  # 50 MB of zeros in ~50 KB
    with pytest.raises(CorruptShardError, match=r"^s.tar: field 'json.gz': inflates to more than 1048576 bytes "):
        gunzip(bomb, 1 << 20, "s.tar: field 'json.gz'")


def test_inflater_never_inflates_much_more_than_asked() -> None:
    """A bomb read a header at a time never holds more than a chunk of its output."""
    stream = Inflater(_reader(gzip.compress(bytes(200 << 20))), "bomb", chunk=1 << 16)
    assert len(stream.read(512)) == 512
    assert stream.consumed < 1 << 17  # the first chunk was enough; nothing more was read


def test_ranges_in_order_are_one_pass() -> None:
    packed = gzip.compress(DATA)
    fetched: list[int] = []
    ranges = Ranges(_fetch(packed, fetched), "s.tgz", keep=0, chunk=10_000)
    cuts = list(range(0, len(DATA), 37_000)) + [len(DATA)]
    assert b"".join(ranges.read(a, b) for a, b in zip(cuts, cuts[1:])) == DATA
    assert ranges.passes == 1
    assert fetched == sorted(set(fetched))  # every compressed byte fetched once


def test_ranges_out_of_order_within_keep_are_one_pass() -> None:
    ranges = Ranges(_fetch(gzip.compress(DATA)), "s.tgz", keep=200_000, chunk=10_000)
    for a, b in [(100_000, 150_000), (10_000, 20_000), (0, 5), (90_000, 110_000), (300_000, 310_000),
                 (150_000, 160_000), (600_000, 700_000), (500_000, 510_000)]:
        assert ranges.read(a, b) == DATA[a:b]
    assert ranges.passes == 1


def test_ranges_further_back_than_keep_start_again() -> None:
    data = DATA * 5  # 3.5 MB: inflated a MB at a time, it is kept by the MB
    ranges = Ranges(_fetch(gzip.compress(data)), "s.tgz", keep=50_000, chunk=100_000)
    assert ranges.read(3_000_000, 3_000_100) == data[3_000_000:3_000_100]
    assert ranges.read(1000, 2000) == data[1000:2000]
    assert ranges.passes == 2
    assert ranges.read(len(data) - 10, len(data) + 100) == data[-10:]  # short where the tar ends
    assert ranges.read(len(data) + 5, len(data) + 9) == b""
    assert ranges.passes == 2
