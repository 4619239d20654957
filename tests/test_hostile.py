"""Hostile input and concurrent writers (issue 40): each case built from a generated input or a
real server on loopback, refused in one line naming the shard, file or URL, with no secret in
any message or chained traceback."""

from __future__ import annotations

import functools
import gzip
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import struct
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from PIL import Image

import shardkit
from shardkit import StreamingDataset, storage
from shardkit.errors import CorruptShardError, DestinationBusyError, ShardkitError, SourceError
from shardkit.formats import lmdb as lmdb_format
from shardkit.formats.gzip import gunzip
from shardkit.reading.tar_dataset import TarDataset

from conftest import ROOT, make_folder
from readers import WARNINGS, failure
from servers import serving
from test_lmdb import records
from test_storage_errors import _Ranges

pytestmark = WARNINGS


# -- hostile tars and indexes: strict header numbers, capped headers, names and inflation --------


def _with_checksum(head: bytearray) -> bytearray:
    """A tar header with its checksum made to match (a hostile writer's, not a damaged one)."""
    head[148:156] = b"%06o\0 " % (sum(head[:148]) + sum(head[156:512]) + 8 * ord(" "))
    return head


def _indexed(folder: Path, name: str, data: bytes, offsets: list[int]) -> Path:
    """`data` as shard `name` of `folder`, with an index.json of version 1 giving `offsets`."""
    from shardkit.index import Index, ShardInfo

    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(data)
    info = ShardInfo(name, len(offsets) - 1, len(data), None, offsets, "gzip" if name.endswith(".gz") else None)
    (folder / "index.json").write_text(Index(shards=(info,)).to_json())
    return folder


def _peak(work: Any) -> tuple[BaseException, int]:
    """The error `work()` raises and the most Python memory it held meanwhile."""
    import tracemalloc

    tracemalloc.start()
    try:
        work()
    except Exception as e:  # noqa: BLE001
        return e, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    raise AssertionError("no error")


@pytest.mark.parametrize("field", [b"-7777777777", b"-1", b" -1", b"+1", b"1_0"])
def test_a_size_field_that_is_not_octal_digits_is_a_corrupt_shard(tmp_path: Path, field: bytes) -> None:
    """`int(x, 8)` takes a sign: a negative size made a bare ValueError (or an offset out of
    range) in both readers and `shardkit index`, and -1 read the rest of the shard into
    memory. A size field of anything but octal digits is a CorruptShardError naming the shard
    and the member, found on the header block (16 MB after it are not read)."""
    from click.testing import CliRunner

    from shardkit.cli import main
    from shardkit.formats.tar_writer import TarWriter

    buf = io.BytesIO()
    writer = TarWriter(buf)
    writer.write("a", {"cls": b"1"})
    writer.write("b", {"bin": bytes(16 << 20)})
    writer.close()
    data = bytearray(buf.getvalue())
    data[124:136] = field.ljust(12, b"\0")
    folder = _indexed(tmp_path / "ds", "a.tar", bytes(_with_checksum(data)), writer.offsets)
    said = re.escape(f"its size field {field!r} is not a number in octal digits")
    err = failure(StreamingDataset(str(folder)), 0)
    assert isinstance(err, CorruptShardError) and re.search(rf"a\.tar \(sample at byte 0\): {said}", str(err)), err
    with pytest.raises(CorruptShardError, match=rf"a\.tar \(sample at byte 0\): {said}"):
        shardkit.TarDataset(str(folder))[0]
    err, peak = _peak(lambda: shardkit.build_index(str(folder / "a.tar")))
    assert isinstance(err, CorruptShardError) and re.search(rf"a\.tar, member at byte 0: {said}", str(err)), err
    assert peak < 4 << 20  # the second sample's 16 MB are not read
    (folder / "index.json").unlink()
    result = CliRunner().invoke(main, ["index", str(folder)])
    assert result.exit_code == 1 and re.fullmatch(
        rf"Error: \S*a\.tar, member at byte 0: {said} \(.*\)\n", result.output
    ), result.output


@pytest.mark.parametrize("kind", [b"x", b"L"])
def test_an_extended_header_over_its_limit_is_refused_before_it_is_read(tmp_path: Path, kind: bytes) -> None:
    """A small .tar.gz whose pax header or GNU long name inflates to gigabytes was read whole
    into memory (6.4 GB for 3 GiB). The header's declared size is checked against
    formats.tar.MAX_HEADER on its header block: here it declares 3 GiB over 64 MB of zeros
    (64 KB compressed), which a read of the whole would hold, and is refused by the index
    build and both readers with almost nothing read."""
    import zlib

    from shardkit.formats import tar

    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip
    pieces = [z.compress(tar.header("././@PaxHeader", 3 << 30, kind))]
    pieces += [z.compress(bytes(1 << 20)) for _ in range(64)]
    folder = _indexed(tmp_path / "ds", "bomb.tar.gz", b"".join([*pieces, z.flush()]), [0, 64 << 20])
    assert (folder / "bomb.tar.gz").stat().st_size < 200_000
    what = {b"x": "pax extended header", b"L": "GNU long name"}[kind]
    said = rf"a {what} of 3221225472 bytes, over the limit of 1048576 \(formats\.tar\.MAX_HEADER\)"
    err, peak = _peak(lambda: shardkit.build_index(str(folder / "bomb.tar.gz")))
    assert re.search(rf"bomb\.tar\.gz, member at byte 0: {said}", str(err)), err
    assert peak < 8 << 20
    err = failure(StreamingDataset(str(folder), max_member_size="64MiB"), 0)
    assert isinstance(err, CorruptShardError) and re.search(rf"bomb\.tar\.gz \(sample at byte 0\): {said}", str(err))
    plain = _indexed(
        tmp_path / "plain", "a.tar", tar.header("././@PaxHeader", 3 << 30, kind) + bytes(8 << 20), [0, 8 << 20]
    )
    err, peak = _peak(lambda: shardkit.TarDataset(str(plain))[0])
    assert re.search(rf"a\.tar \(sample at byte 0\): {said}", str(err)) and peak < 4 << 20, (err, peak)


def test_names_and_pax_records_are_held_to_their_limits(tmp_path: Path) -> None:
    """A pax record longer than its declared length was accepted (the image landed under a
    field named 'jpg\\n'); a 100 MB GNU long name became a 100 MB key. A record must end in a
    newline where its length says, and a name may take formats.tar.MAX_NAME bytes; the writer
    refuses what the readers would."""
    from shardkit.formats import tar, tar_writer

    def member(kind: bytes, data: bytes) -> bytes:
        return tar.header("././@PaxHeader", len(data), kind) + data + bytes(-len(data) % 512)

    image = tar.header("k.jpg", 3) + b"jpg" + bytes(509)
    cases = {
        "long.tar": (b"15 path=k.jpg\n", "a malformed pax header record at byte 0"),  # 14 bytes, said 15
        "short.tar": (b"13 path=k.jpg\n", "a malformed pax header record at byte 0"),  # said 13: no newline there
        "name.tar": (b"4108 path=" + b"n" * 4097 + b"\n", "a member name of 4097 bytes, over the limit of 4096"),
    }
    for name, (record, said) in cases.items():
        data = member(b"x", record) + image + bytes(1024)
        folder = _indexed(tmp_path / name.removesuffix(".tar"), name, data, [0, len(data) - 1024])
        with pytest.raises(CorruptShardError, match=rf"{name}, member at byte 0: {said}"):
            shardkit.build_index(str(folder / name))
        err = failure(StreamingDataset(str(folder)), 0)
        assert re.search(rf"{name} \(sample at byte 0\), member at byte 0: {said}", str(err)), err
    long_name = member(b"L", b"n" * 4097 + b"\0") + image + bytes(1024)
    gnu = _indexed(tmp_path / "gnu", "gnu.tar", long_name, [0, len(long_name) - 1024])
    with pytest.raises(CorruptShardError, match=r"gnu\.tar, member at byte 0: a member name of 4097 bytes, over"):
        shardkit.build_index(str(gnu / "gnu.tar"))
    with pytest.raises(ValueError, match=r"tar member name of 4101 bytes, over 4096"):
        tar_writer.TarWriter(io.BytesIO()).write("k" * 4097, {"jpg": b""})
    fine = member(b"x", b"14 path=k.jpg\n") + image + bytes(1024)  # the record as tarfile writes it
    assert [s["__key__"] for s in StreamingDataset(str(_indexed(tmp_path / "ok", "ok.tar", fine, [0, 2048])))] == ["k"]


@pytest.mark.parametrize("kind", ["zip", None, 7, ["tar"]])
def test_an_index_of_an_unknown_kind_is_refused_naming_it(packed: Path, tmp_path: Path, kind: Any) -> None:
    """`kind` was never checked: StreamingDataset read the shards as tar whatever it said,
    `verify` passed them and TarDataset raised an AttributeError (or, for "zip", advised
    LMDBDataset). Every reader and `verify` now refuse it in one line naming index.json."""
    from click.testing import CliRunner

    from shardkit.cli import main

    copy = Path(shutil.copytree(packed, tmp_path / "copy"))
    doc = json.loads((copy / "index.json").read_text())
    (copy / "index.json").write_text(json.dumps({**doc, "kind": kind}))
    said = re.escape(f"{copy}/index.json: kind {kind!r}, not a format this shardkit reads ('tar' or 'lmdb')")
    for read in (StreamingDataset, shardkit.TarDataset, shardkit.verify):
        with pytest.raises(CorruptShardError, match=rf"^{said}$"):
            read(str(copy))
    result = CliRunner().invoke(main, ["verify", str(copy)])
    assert result.exit_code == 1 and re.fullmatch(rf"Error: {said}\n", result.output), result.output


def test_verify_refuses_an_index_the_readers_refuse(packed: Path, tmp_path: Path) -> None:
    """A version 1 index without sample offsets: `verify` said "all shards match" while both
    readers refuse it; it now names index.json and says how to rebuild it."""
    from conftest import as_version_1

    copy = as_version_1(packed, tmp_path / "copy")
    doc = json.loads((copy / "index.json").read_text())
    for shard in doc["shards"][1:]:
        del shard["offsets"]
    (copy / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ShardkitError, match="the index lists no sample offsets"):
        StreamingDataset(str(copy))
    problems = shardkit.verify(str(copy))
    assert problems == [
        f"{copy}/index.json: lists no sample offsets for {len(doc['shards']) - 1} of its "
        f"{len(doc['shards'])} shards (first: shard-000001.tar), and readers refuse it: rebuild it "
        f"with `shardkit index {copy}`"
    ]


def test_gunzip_refuses_a_bomb_holding_no_more_than_its_limit() -> None:
    """A .gz field was refused at its limit only after holding it twice (2.3 GB for 1 GiB):
    one read of `limit` bytes keeps zlib's pieces and their join. A bomb whose gzip trailer
    gives its size away is refused before any inflating; one with a forged trailer as it
    passes the limit, inflated a piece at a time."""
    import tracemalloc

    honest = gzip.compress(bytes(64 << 20), 9)  # 64 MB of zeros in ~64 KB
    forged = honest[:-4] + (100).to_bytes(4, "little")  # its trailer says 100 bytes
    limit = 16 << 20
    for bomb, said, most in (
        (honest, r"max_member_size; its gzip trailer says 67108864\)", 1 << 20),
        (forged, r"max_member_size\)", limit * 13 // 10),
    ):
        tracemalloc.start()
        try:
            with pytest.raises(CorruptShardError, match=rf"^f: inflates to more than {limit} bytes \({said}: a "):
                gunzip(bomb, limit, "f")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < most, peak
    assert gunzip(gzip.compress(bytes(limit)), limit, "f") == bytes(limit)  # at the limit: whole


# -- hostile images ------------------------------------------------------------------------------


def _claiming(claim: tuple[int, int], seed: int = 0) -> bytes:
    """A JPEG of 16x16 noise whose frame header claims `claim` (width, height) pixels."""
    import struct

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(out, "JPEG")
    data, pos = bytearray(out.getvalue()), 2
    while data[pos + 1] != 0xC0:  # to the start of frame
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    data[pos + 5 : pos + 9] = struct.pack(">HH", claim[1], claim[0])
    return bytes(data)


def test_a_jpeg_whose_header_claims_more_pixels_than_its_scans_hold_is_refused(photos: Path, tmp_path: Path) -> None:
    """A header claiming 2000x2000 over a 16x16 scan passed pack, --decode-check and --resize,
    decoding to grey (libjpeg-turbo only warns, and PIL takes that for a success). Too few
    bytes of scans for the pixels claimed (one bit per 8x8 block at the least) is refused by
    the cheap check; one whose scans end early (libjpeg-turbo: "premature end of data
    segment") by every check that decodes: --decode-check, --resize, verify --decode."""
    from shardkit.tools.verify import undecodable

    (photos / "circle" / "liar.jpg").write_bytes(_claiming((2000, 2000)))
    (photos / "circle" / "small_liar.jpg").write_bytes(_claiming((64, 64), seed=1))  # scans long enough for 64x64
    both = ["circle/liar.jpg", "circle/small_liar.jpg"]
    for options, refused in (({}, both[:1]), ({"decode_check": True}, both), ({"resize": 8}, both)):
        idx = shardkit.pack(str(photos), str(tmp_path / f"out{list(options)}"), workers=1, progress=False, **options)
        reasons = {s.path: s.reason for s in idx.skipped}
        assert sorted(reasons) == refused and idx.samples == 32 - len(refused), options
        bound = (
            r"truncated image: 2000x2000 pixels in \d+ bytes of scans, fewer than the 11719 that even a blank image "
            r"of that size takes \(its header claims more pixels than its data holds\)"
        )
        cut = r"truncated image: its data ends before its pixels do \(libjpeg-turbo: .*premature end of data segment\)"
        assert all(re.fullmatch(bound if not options and path == both[0] else cut, reasons[path]) for path in refused)
    with pytest.raises(SourceError, match=r"circle/liar\.jpg: truncated image: 2000x2000 pixels in \d+ bytes"):
        shardkit.pack(str(photos), str(tmp_path / "fail"), workers=1, progress=False, on_error="raise")
    (problem,) = undecodable(str(tmp_path / "out[]"), workers=0)  # packed by the cheap checks: found by verify
    assert (
        "(packed from circle/small_liar.jpg): field 'jpg': truncated image: its data ends before its pixels" in problem
    )


# -- a full disk under an LMDB pack --------------------------------------------------------------

_LIMITED = (
    "import os, resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    "resource.setrlimit(resource.RLIMIT_FSIZE, (60000, 60000)); {disk}from shardkit.cli import main; main()"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE")
def test_a_full_disk_during_an_lmdb_pack_is_one_line_and_a_rerun_completes(tmp_path: Path) -> None:
    """A disk that fills up mid-transaction makes LMDB say only "mdb_txn_commit:
    Input/output error" (a short write): that was a 43-line traceback naming neither DEST nor
    the cause. Writes cut short by a file size limit (the same short write) fail the pack in
    one line naming DEST and the cause, the free space looked at: a full disk as statvfs says
    it (here the child's statvfs reports 0 bytes free), or the limit itself. A rerun resumes
    after the last job written and ends with the whole dataset."""
    src = make_folder(tmp_path / "src", per_class=20)
    out = tmp_path / "out"
    full = "os.statvfs = lambda path: os.statvfs_result((4096, 4096) + (0,) * 8); "  # a full disk, as statvfs says it
    for disk, cause in (
        ("", r"data\.mdb \(\d+ bytes\) reached this process's file size limit \(ulimit -f: 60000 bytes\)"),
        (full, r"no space left on device \(0 bytes free on its disk, the write needed \d+ and more\)"),
    ):
        cmd = [
            sys.executable,
            "-c",
            _LIMITED.format(disk=disk),
            "pack",
            str(src),
            str(out),
            "--format",
            "lmdb",
            "--max-count",
            "10",
            "--workers",
            "1",
            "-q",
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 1 and re.fullmatch(
            rf"Error: {re.escape(str(out))}: writing the LMDB failed: {cause} \(LMDB said: mdb_txn_commit: [^()]+\); "
            r"make room and rerun the same `shardkit pack`, which resumes after the last job written\n",
            result.stderr,
        ), result.stderr
    assert 0 < len(records(out)) and not (out / "index.json").exists()  # jobs committed before it, no index
    lmdb_format.close_reader(str(out))
    stats: dict[str, int] = {}
    assert (
        shardkit.pack(str(src), str(out), format="lmdb", max_count=10, workers=1, progress=False, stats=stats).samples
        == 60
    )
    assert stats["kept"] > 0 and shardkit.verify(str(out)) == []


# -- concurrent packs into a local DEST: its flock -----------------------------------------------

_HOLD = (
    "import sys\nfrom shardkit.packing import lock\nwith lock.held(sys.argv[1]):\n    print('held', flush=True)\n"
    "    sys.stdin.read()\n"
)


def _holding(dest: Path) -> subprocess.Popen[str]:
    """A process holding DEST's lock until its stdin closes (or it is killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(dest)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def test_a_second_pack_into_one_dest_is_refused_naming_the_first(photos: Path, tmp_path: Path) -> None:
    """Two packs into one DEST deleted each other's temporary files and replaced each other's
    shards, and one could say "packed" over the other's. The second is refused at once, in
    one line naming DEST, the holder and its lock, before it touches anything."""
    import socket

    from click.testing import CliRunner

    from shardkit.cli import main
    from shardkit.errors import DestinationBusyError

    out = tmp_path / "out"
    (out / ".shardkit-progress").mkdir(parents=True)  # a pack under way: its shard half written
    (out / "shard-000000.tar.tmp-0123456789ab").write_bytes(b"half a shard")
    with _holding(out) as holder:
        said = (
            rf"{re.escape(str(out))}: another pack is writing into it \(pid {holder.pid} on "
            rf"{re.escape(socket.gethostname())}, since [-+:T\d]+; it holds "
            rf"{re.escape(str(out / '.shardkit-lock'))}\): wait for it to end, or pack into another folder"
        )
        for fmt in ("tar", "lmdb"):
            with pytest.raises(DestinationBusyError, match=rf"^{said}$"):
                shardkit.pack(str(photos), str(out), format=fmt, workers=1, progress=False)
        result = CliRunner().invoke(main, ["pack", str(photos), str(out), "-q"])
        assert result.exit_code == 1 and re.fullmatch(rf"Error: {said}\n", result.output), result.output
        assert (out / "shard-000000.tar.tmp-0123456789ab").read_bytes() == b"half a shard"
    # (the holder's stdin closed: it let go)
    assert not (out / ".shardkit-lock").exists()  # its holder removes it as it lets go
    assert shardkit.pack(str(photos), str(out), workers=1, progress=False).samples == 30
    assert not (out / ".shardkit-lock").exists() and shardkit.verify(str(out)) == []


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_the_lock_of_a_killed_pack_is_no_lock(photos: Path, tmp_path: Path, fmt: str) -> None:
    """A holder killed with SIGKILL leaves its lock file, but the kernel has let go of its
    lock: the next pack takes it, with nothing for anyone to remove."""
    out = tmp_path / "out"
    with _holding(out) as holder:
        holder.kill()
    assert json.loads((out / ".shardkit-lock").read_text())["pid"] == holder.pid
    assert shardkit.pack(str(photos), str(out), format=fmt, workers=1, progress=False).samples == 30
    assert not (out / ".shardkit-lock").exists()


def test_two_packs_into_one_dest_at_once_never_both_succeed(tmp_path: Path) -> None:
    """Started together with different sources: one packs, the other fails naming why (the
    first holds DEST, or has already filled it), and DEST holds the winner's dataset whole."""
    sources = [make_folder(tmp_path / "a", per_class=20), make_folder(tmp_path / "b", per_class=10)]
    out = tmp_path / "out"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shardkit.cli",
                "pack",
                str(src),
                str(out),
                "--max-count",
                "4",
                "--workers",
                "1",
                "-q",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for src in sources
    ]
    said_by = [proc.communicate(timeout=120)[1] for proc in procs]
    results = [(proc.returncode, said) for proc, said in zip(procs, said_by)]
    assert sorted(code for code, _ in results) == [0, 1], results
    won, (_, said) = [code for code, _ in results].index(0), sorted(results)[1]
    assert re.fullmatch(
        r"Error: \S+out: (another pack is writing into it .*|already holds a different dataset .*)\n", said
    ), said
    assert shardkit.verify(str(out)) == [] and shardkit.index.load(str(out)).samples == (60, 30)[won]


# -- exclusive writers on object stores: conditional writes and DEST's lease ---------------------


@pytest.fixture(params=["local", "s3", "gcs", "azure"])
def conditional(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict | None]:
    """(folder URL, storage options) on each store with conditional writes; GCS through a gate
    of GCS's precondition rules (servers/gate.py), which the emulator ignores."""
    if request.param == "local":
        return str(tmp_path / "dest"), None
    remote = request.getfixturevalue("gcs_conditional" if request.param == "gcs" else request.param)
    return remote["url"] + "/dest", remote["storage_options"]


def test_conditional_writes_succeed_only_at_the_version_seen(conditional: tuple[str, dict | None]) -> None:
    from shardkit.storage.stores import store_for

    folder, opts = conditional
    storage.makedirs(folder, opts)
    url = folder + "/x"
    store = store_for(url, opts)
    assert store.conditional_writes and store.read_versioned(url) is None
    first = store.put_if_absent(url, b"one")
    assert first is not None and store.put_if_absent(url, b"two") is None
    assert store.read_versioned(url) == (b"one", first)
    second = store.replace_if(url, b"three", first)
    assert second is not None and second != first
    assert store.replace_if(url, b"four", first) is None and store.remove_if(url, first) is False
    assert store.read_versioned(url) == (b"three", second)
    assert store.remove_if(url, second) is True and store.read_versioned(url) is None
    assert store.replace_if(url, b"five", second) is None and store.remove_if(url, second) is False
    assert store.read_versioned(url) is None


@pytest.fixture(params=["s3", "gcs", "azure"])
def bucket(request: pytest.FixtureRequest) -> tuple[str, dict]:
    """(DEST URL, storage options) in a bucket of each object store with conditional writes."""
    remote = request.getfixturevalue("gcs_conditional" if request.param == "gcs" else request.param)
    return remote["url"] + "/ds", remote["storage_options"]


# A pack in another process that stops before its commit (once every shard is in place) until
# a line comes on its stdin: a pack under way, for as long as a test needs one.
_PAUSED = """import json, sys
import shardkit
from shardkit import index
with_pins = index.with_pins
def paused(*args, **kwargs):
    print("paused", flush=True)
    sys.stdin.readline()
    return with_pins(*args, **kwargs)
index.with_pins = paused
shardkit.pack(sys.argv[1], sys.argv[2], max_count=4, workers=1, progress=False, storage_options=json.loads(sys.argv[3]))
print("packed", flush=True)
"""


def _paused_pack(src: Path, dest: str, opts: dict, **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PAUSED, str(src), dest, json.dumps(opts)],
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **env},
    )
    assert proc.stdout is not None and proc.stdout.readline() == "paused\n", proc.communicate(timeout=60)
    return proc


def _go_on(proc: subprocess.Popen[str]) -> tuple[str, str]:
    out, err = proc.communicate("\n", timeout=120)
    return out, err


def _lock_note(dest: str, opts: dict) -> dict | None:
    from shardkit.storage.stores import store_for

    found = store_for(dest + "/.shardkit-lock", opts).read_versioned(dest + "/.shardkit-lock")
    return None if found is None else json.loads(found[0])


def test_a_second_pack_into_a_bucket_is_refused_naming_the_first(
    bucket: tuple[str, dict], photos: Path, tmp_path: Path
) -> None:
    """Issue 40: a remote DEST had no lock, so two packs into one prefix replaced each other's
    shards. The lock object is created conditionally (If-None-Match: * / ifGenerationMatch=0)
    and names its holder; a second pack fails at once, before it writes anything."""
    dest, opts = bucket
    other = make_folder(tmp_path / "other", per_class=2)
    first = _paused_pack(photos, dest, opts)
    try:
        note = _lock_note(dest, opts)
        assert note is not None and note["pid"] == first.pid and note["lease_s"] == 120
        said = (
            rf"{re.escape(dest)}: another pack is writing into it \(run {note['run'][:12]}, pid {first.pid} on "
            rf"{re.escape(socket.gethostname())}, since [-+:T\d]+; it holds {re.escape(dest)}/\.shardkit-lock\): "
            r"wait for it to end, or pack into another prefix; it was refreshed \d+ s ago: a pack that died is "
            r"taken over once its lease has run out, in \d+ s"
        )
        with pytest.raises(DestinationBusyError, match=rf"^{said}$"):
            shardkit.pack(str(other), dest, workers=1, progress=False, storage_options=opts)
    finally:
        out, err = _go_on(first)
    assert first.returncode == 0 and out == "packed\n", err
    assert _lock_note(dest, opts) is None  # let go as it ended
    assert shardkit.verify(dest, storage_options=opts) == []
    assert shardkit.index.load(dest, opts).samples == 30  # the first pack's, whole


def test_a_lock_not_refreshed_for_its_lease_is_taken_over(
    bucket: tuple[str, dict], photos: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder that stops refreshing (stopped here with SIGSTOP, as a machine that froze or
    lost its network) loses its lock once its lease has run out: the next pack takes it over by
    a conditional replace; the old holder, woken, finds it gone and stops before its commit."""
    dest, opts = bucket
    first = _paused_pack(photos, dest, opts, SHARDKIT_LOCK_LEASE_S="1.5")
    os.kill(first.pid, signal.SIGSTOP)
    try:
        time.sleep(2.0)  # a lease and more since its last refresh (every 0.375 s)
        with caplog.at_level(logging.WARNING, logger="shardkit"):
            assert (
                shardkit.pack(str(photos), dest, max_count=4, workers=1, progress=False, storage_options=opts).samples
                == 30
            )
    finally:
        os.kill(first.pid, signal.SIGCONT)
        _, err = _go_on(first)
    (took,) = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert re.fullmatch(
        rf"{re.escape(dest)}: took over the lock of a pack gone \(run \w+, pid {first.pid} on .*; "
        r"not refreshed for \d+ s, over its lease of 2 s\)",
        took,
    ), took
    assert first.returncode == 1 and re.search(
        rf"DestinationBusyError: {re.escape(dest)}: another pack took this "
        r"pack's lock over \(.*\) after 2 s without a refresh",
        err,
    ), err
    assert _lock_note(dest, opts) is None and shardkit.verify(dest, storage_options=opts) == []


def test_a_killed_pack_into_a_bucket_is_rerun_at_once(
    bucket: tuple[str, dict], photos: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pack killed with SIGKILL leaves its lock object behind; a rerun on the same machine
    sees that its holder's process has ended (boot id, pid namespace, pid and start time) and
    takes it over at once, keeping the killed pack's finished shards."""
    dest, opts = bucket
    first = _paused_pack(photos, dest, opts)
    first.kill()
    first.communicate(timeout=60)  # reaped: no zombie left to look alive
    note = _lock_note(dest, opts)
    assert note is not None and note["pid"] == first.pid
    stats: dict[str, int] = {}
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        idx = shardkit.pack(
            str(photos), dest, max_count=4, workers=1, progress=False, storage_options=opts, stats=stats
        )
    assert idx.samples == 30 and stats["kept"] == 30 and stats["written"] == 0  # its shards were all in place
    assert any(f"its process {first.pid} on this machine has ended" in r.getMessage() for r in caplog.records)
    assert _lock_note(dest, opts) is None and shardkit.verify(dest, storage_options=opts) == []


def test_two_packs_taking_over_one_stale_lock_never_both_win(conditional: tuple[str, dict | None]) -> None:
    """Both read the stale lock, then both replace it conditionally on the version read: one
    succeeds, the other finds the winner's lock and is refused. (Not run on moto: its server
    checks a condition and writes in two steps, not atomically; S3 itself is atomic.)"""
    from shardkit.packing.lock_lease import Lease
    from shardkit.storage.stores import store_for

    folder, opts = conditional
    if folder.startswith("s3://"):
        pytest.skip("moto checks If-Match and writes in two steps: a race between two writers is not its to settle")
    storage.makedirs(folder, opts)
    url = folder + "/.shardkit-lock"
    store = store_for(url, opts)
    stale = {
        "run": "0" * 32,
        "pid": 1,
        "host": "elsewhere",
        "since": "2026-01-01T00:00:00+0000",
        "lease_s": 60.0,
        "refreshed": time.time() - 600,
    }
    assert store.put_if_absent(url, json.dumps(stale).encode()) is not None
    both_read = threading.Barrier(2, timeout=30)
    read = store.read_versioned
    first_read: set[int] = set()

    def read_then_wait(u: str) -> tuple[bytes, str] | None:
        found = read(u)
        if threading.get_ident() not in first_read:  # each taker's first look: both see the stale lock
            first_read.add(threading.get_ident())
            both_read.wait()
        return found

    store.read_versioned = read_then_wait  # type: ignore[method-assign]
    outcomes: list[Any] = []

    def take() -> None:
        lease = Lease(store, url, folder, 60.0)
        try:
            lease.take()
            outcomes.append(lease)
        except DestinationBusyError as e:
            outcomes.append(e)

    takers = [threading.Thread(target=take) for _ in range(2)]
    for t in takers:
        t.start()
    for t in takers:
        t.join(60)
    (won,) = [o for o in outcomes if isinstance(o, Lease)]
    (lost,) = [o for o in outcomes if isinstance(o, DestinationBusyError)]
    assert f"run {won.note['run'][:12]}" in str(lost)
    assert json.loads(read(url)[0])["run"] == won.note["run"]  # type: ignore[index]
    won.release()
    assert read(url) is None


# -- shards behind presigned or plain HTTPS URLs: versions recorded and checked -----------------

SIGNED = (
    "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAFAKE%2F20260101%2Fus-east-1%2Fs3%2Faws4_request"
    "&X-Amz-Signature=" + "5e" * 32
)


class _Tagged(_Ranges):
    """A static file server with ranges that sends an ETag, as nginx does (from the file's
    modification time and size); _Ranges alone sends only Last-Modified (to a HEAD)."""

    def end_headers(self) -> None:
        path = self.translate_path(self.path)
        if os.path.isfile(path):
            st = os.stat(path)
            self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')
        super().end_headers()


def _replace_in_place(shard: Path) -> None:
    """Rewrite a shard with one byte of its first member's data changed, at the same size (its
    tar headers and offsets all still hold: nothing but its version tells), a minute later."""
    data = bytearray(shard.read_bytes())
    data[512 + 100] ^= 0xFF  # inside the first member's data (its header is the first 512 bytes)
    shard.write_bytes(bytes(data))
    later = shard.stat().st_mtime + 60
    os.utime(shard, (later, later))


@pytest.mark.parametrize("reader", ["stream", "map"])
@pytest.mark.parametrize("handler", [_Ranges, _Tagged], ids=["last-modified", "etag"])
def test_a_shard_replaced_behind_its_signed_url_is_named_at_its_first_read(
    packed: Path, tmp_path: Path, handler: type[_Ranges], reader: str
) -> None:
    """Issue 40, fail 6: a list of presigned HTTPS URLs recorded no version, so a shard
    replaced behind its URL was read silently. Its version (ETag, else Last-Modified) is taken
    as the dataset is made, and checked as a reader first opens the shard."""
    www = tmp_path / "www" / "ds"
    shutil.copytree(packed, www)
    for p in www.iterdir():
        if not p.name.endswith(".tar"):
            p.unlink()  # a bucket's other objects are not signed for: the list's shards are scanned
    names = sorted(p.name for p in www.iterdir())
    with serving(functools.partial(handler, directory=str(tmp_path / "www"))) as base:
        urls = [f"{base}/ds/{n}{SIGNED}" for n in names]
        ds: Any = StreamingDataset(urls, shuffle=False) if reader == "stream" else TarDataset(urls)
        assert all(
            s.version is not None and set(s.version) == {"etag" if handler is _Tagged else "last_modified"}
            for s in ds.index.shards
        )
        _replace_in_place(www / names[1])
        first = ds.index.shards[0].samples
        got: list[str] = []
        with pytest.raises(CorruptShardError, match=rf"/ds/{names[1]}\?\*\*\*: changed since its index was made") as e:
            for i, sample in enumerate(ds if reader == "stream" else (ds[i] for i in range(len(ds)))):
                got.append(sample["__url__"])
                assert i < first, "a sample of the replaced shard was read"
        assert "5e5e" not in str(e.value) and len(got) == first


# -- no secret in any message, repr or chained traceback -----------------------------------------

# Recognisable fake credentials, assembled so that no line of code a traceback quotes holds one
_FAKE = {name: f"FAKE{name.upper()}" + "7" * 12 for name in ("cred", "sig", "session", "key", "secret", "token")}
PRESIGNED = (
    f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={_FAKE['cred']}%2F20260101%2Fus-east-1%2Fs3"
    f"%2Faws4_request&X-Amz-Security-Token={_FAKE['session']}&X-Amz-Signature={_FAKE['sig']}"
)
CREDENTIALS = {"key": _FAKE["key"], "secret": _FAKE["secret"], "token": _FAKE["token"]}
FAULTS = ["refused", "403", "404", "500", "reset", "silent"]


def _every_text(e: BaseException | None, seen: set[int] | None = None) -> str:
    """Everything an error shows anywhere: each error of its chain (causes and contexts, the
    suppressed ones too) formatted with its traceback, its repr and its args."""
    seen = set() if seen is None else seen
    if e is None or id(e) in seen:
        return ""
    seen.add(id(e))
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__, chain=False)) + repr(e) + repr(e.args)
    return text + _every_text(e.__cause__, seen) + _every_text(e.__context__, seen)


def _raised(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - whatever it is, it is looked at
        return e
    raise AssertionError("no error")


def _no_secret_in(e: BaseException, names: str) -> None:
    assert isinstance(e, ShardkitError), _every_text(e)
    assert names in str(e) and len(str(e).splitlines()) == 1, str(e)
    text = _every_text(e)
    assert not [v for v in _FAKE.values() if v in text], text


class _Faulty(_Ranges):
    """A static file server with ranges that, once `fault` is set, answers every request with
    it: an HTTP status (with S3's XML error), a reset (RST), or silence."""

    fault: ClassVar[str] = ""

    def do_GET(self) -> None:
        if not self.fault:
            return super().do_GET()
        if self.fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if self.fault == "silent":
            time.sleep(0.75)  # past botocore's 0.5 s read timeout; a presigned GET (its own timeout) sees the close
            self.close_connection = True
            return
        code = {"403": "AccessDenied", "404": "NoSuchKey", "500": "InternalError"}[self.fault]
        body = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
        self.send_response(int(self.fault))
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        if not self.fault:
            return super().do_HEAD()
        self.do_GET()

    do_PUT = do_POST = do_DELETE = do_GET


@pytest.fixture
def faulty(tmp_path: Path, packed: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The base URL of a _Faulty server over a folder holding the packed dataset as ds/ and as
    the S3 bucket bucket/ds (no fault set yet); retries cut to 2 attempts."""
    from shardkit.storage import patience

    monkeypatch.setattr(patience, "RETRIES", 2)
    monkeypatch.setattr(patience, "OUTAGE_RETRIES", 2)
    (tmp_path / "www" / "bucket").mkdir(parents=True)
    os.symlink(packed, tmp_path / "www" / "ds")
    os.symlink(packed, tmp_path / "www" / "bucket" / "ds")
    _Faulty.fault = ""
    try:
        with serving(functools.partial(_Faulty, directory=str(tmp_path / "www"))) as base:
            yield base
    finally:
        _Faulty.fault = ""


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


_QUICK = {"timeout": 0.5}


@pytest.mark.parametrize("fault", FAULTS)
def test_no_secret_of_a_presigned_url_in_any_error(faulty: str, fault: str) -> None:
    """Issue 40, fail 7: a refused connection to a presigned URL was raised `from` fsspec's
    FileNotFoundError(url), so every printed traceback showed X-Amz-Credential, -Security-Token
    and -Signature. Every lower layer's error is now a cause redacted of them (RedactedError),
    with no raw one left as a context either: each remote fault, each way in."""
    base = _dead_endpoint() if fault == "refused" else faulty
    signed = f"{base}/ds/shard-000000.tar{PRESIGNED}"
    ready = StreamingDataset([f"{faulty}/ds/shard-000000.tar{PRESIGNED}"], storage_options=_QUICK, shuffle=False)
    mapped = TarDataset([f"{faulty}/ds/shard-000001.tar{PRESIGNED}"], storage_options=_QUICK)
    _Faulty.fault = fault
    calls: list[Callable[[], Any]] = [
        lambda: storage.read_bytes(signed, _QUICK),
        lambda: storage.read_range(signed, 0, 100, _QUICK),
        lambda: StreamingDataset([signed], storage_options=_QUICK),
        lambda: TarDataset([signed], storage_options=_QUICK),
        lambda: next(iter(ready)),  # a dataset made while the server answered: its reads fail
        lambda: mapped[0],
    ]
    for call in calls:
        e = _raised(call)
        _no_secret_in(e, "/ds/shard-00000")
        assert "?***" in str(e)


@pytest.mark.parametrize("fault", FAULTS)
def test_no_secret_of_s3_credentials_in_any_error(faulty: str, fault: str, photos: Path) -> None:
    """The storage options' key, secret and session token (which shardkit's presigned GETs
    put in their URLs) stay out of every error too: reading, listing, packing."""
    base = _dead_endpoint() if fault == "refused" else faulty
    opts = {**CREDENTIALS, "client_kwargs": {"endpoint_url": base}, "timeout": 0.5, "skip_instance_cache": True}
    _Faulty.fault = fault
    calls: list[tuple[Callable[[], Any], str]] = [
        (lambda: storage.read_bytes("s3://bucket/ds/index.json", opts), "s3://bucket/ds/index.json"),
        (lambda: StreamingDataset("s3://bucket/ds", storage_options=opts), "s3://bucket/ds"),
        (lambda: StreamingDataset(["s3://bucket/ds/shard-000000.tar"], storage_options=opts), "shard-000000.tar"),
        (lambda: shardkit.verify("s3://bucket/ds", storage_options=opts), "s3://bucket/ds"),
        (
            lambda: shardkit.pack(str(photos), "s3://bucket/out", workers=1, progress=False, storage_options=opts),
            "s3://bucket/out",
        ),
    ]
    for call, names in calls:
        _no_secret_in(_raised(call), names)


def test_no_secret_in_the_repr_of_a_pack_plan(photos: Path, tmp_path: Path) -> None:
    """A pack's plan and each of its jobs carry the storage options (to every worker): their
    reprs leave them out."""
    from shardkit.packing.plan import make_plan

    plan = make_plan(str(photos), str(tmp_path / "out"), storage_options=CREDENTIALS)
    assert plan.storage_options == CREDENTIALS
    assert not [v for v in _FAKE.values() if v in repr(plan) + repr(plan.job(0))]


def test_a_read_spec_shows_no_secret() -> None:
    """What a worker's pass is given travels in reprs (a debugger, a log line): its presigned
    URLs and storage options stay out of them."""
    import numpy as np

    from shardkit.reading.spec import ReadSpec, SampleOrder

    spec = ReadSpec(
        ("https://b.s3.amazonaws.com/x.tar?X-Amz-Signature=SIGNATURE1234",),
        {"key": "AKIAFAKEKEY", "secret": "FAKESECRET1234"},
        (None,),
        (None,),
        SampleOrder(np.array([1]), 0, False, 64),
    )
    shown = repr(spec)
    assert not any(s in shown for s in ("SIGNATURE1234", "AKIAFAKEKEY", "FAKESECRET1234"))


# -- what `pip install '.[s3,gcs]'` resolves to -----------------------------------------------------


def test_the_core_and_remote_dependencies_carry_lower_bounds_met_here() -> None:
    """Unbounded, `pip install '.[s3,gcs]'` settled on s3fs 0.4.2 (2019). Every core dependency and
    every one of the s3, gcs and azure extras (and their clients wherever named) has a `>=` bound,
    which the versions the tests run with meet."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    remote = {"s3fs", "gcsfs", "botocore", "adlfs", "azure-storage-blob"}
    named = [*project["dependencies"], *extras["s3"], *extras["gcs"], *extras["azure"]]
    named += [d for deps in extras.values() for d in deps if Requirement(d).name.lower() in remote]
    for dep in map(Requirement, named):
        bounds = [s for s in dep.specifier if s.operator == ">="]
        assert bounds, f"pyproject.toml: {dep} has no lower bound"
        try:
            installed = importlib.metadata.version(dep.name)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert dep.specifier.contains(installed, prereleases=True), f"{dep.name} {installed} is outside {dep}"


# -- hostile source folders: names shown escaped, sizes checked before a file is read -----------

FORGED = "a\nError: forged.jpg"  # a file name that, printed raw, starts a line of its own


def _forged_name(photos: Path) -> Path:
    """`photos` with a file named FORGED in its first class folder: no JPEG, so unusable."""
    folder = next(p for p in sorted(photos.iterdir()) if p.is_dir())
    fd = os.open(folder / FORGED, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b"not a jpeg, but named as one")
    os.close(fd)
    return photos


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_file_name_holding_a_newline_is_shown_escaped(photos: Path, tmp_path: Path, on_error: str) -> None:
    """Under --on-error raise (its error) and skip (its report) the name is one line, its newline
    written `\\n`: shown raw, or with the newline as a space, it named no real file and could
    forge an `Error:` line."""
    from click.testing import CliRunner

    from shardkit.cli import main

    result = CliRunner().invoke(
        main, ["pack", str(_forged_name(photos)), str(tmp_path / "out"), "--on-error", on_error]
    )
    assert result.exit_code == (1 if on_error == "raise" else 0), result.output
    out = result.output
    assert "a\\nError: forged.jpg" in out, out
    assert not any(line.lstrip().startswith(("Error: forged", "forged")) for line in out.splitlines()), out
    assert sum(line.startswith("Error:") for line in out.splitlines()) == (on_error == "raise"), out


def _sparse_jpg(photos: Path, size: int = 2 << 30) -> Path:
    """A `size`-byte `.jpg` of holes in `photos`' first class folder: no disk, and no JPEG."""
    path = next(p for p in sorted(photos.iterdir()) if p.is_dir()) / "huge.jpg"
    path.touch()
    os.truncate(path, size)
    return path


def test_a_file_over_the_size_limit_is_skipped_before_it_is_read(photos: Path, tmp_path: Path) -> None:
    """A 2 GB sparse `.jpg` was read whole (4.2 GB peak), then skipped as no image. By the
    listing's size it is skipped unread at the default limit of 1 GiB: the reason says so,
    where a read would have called it no image."""
    huge = _sparse_jpg(photos)
    idx = shardkit.pack(photos, tmp_path / "out", workers=1)
    (skip,) = [s for s in idx.skipped if s.path.endswith("huge.jpg")]
    assert (
        skip.reason == "2.1 GB (2147483648 bytes), over the limit of 1.1 GB (1073741824 bytes; "
        "--max-file-size, max_file_size=): not read"
    ), skip.reason
    assert idx.samples == 30
    huge.unlink()


def test_a_file_over_the_size_limit_stops_a_pack_under_raise_naming_it(photos: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from shardkit.cli import main

    huge = _sparse_jpg(photos, 3 << 20)
    result = CliRunner().invoke(
        main, ["pack", str(photos), str(tmp_path / "out"), "--on-error", "raise", "--max-file-size", "2MiB", "-q"]
    )
    assert result.exit_code == 1, result.output
    (line,) = result.output.splitlines()
    assert line.startswith(f"Error: {huge}: 3.1 MB (3145728 bytes), over the limit of 2.1 MB (2097152 bytes; "), line


def test_a_file_over_the_size_limit_is_not_opened(photos: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In the job itself, no read at all: the size the listing gave is enough."""
    from shardkit.packing import images, jobs
    from shardkit.packing.plan import Options, make_plan

    _sparse_jpg(photos, 5000)
    plan = make_plan(
        str(photos),
        str(photos.parent / "out"),
        max_count=None,
        max_size=None,
        shuffle=False,
        seed=0,
        options=Options(max_file_size=4096),
    )
    job = plan.job(0)
    (item,) = [it for it in job.items if it.path.endswith("huge.jpg")]
    monkeypatch.setattr(jobs.storage, "read_bytes", lambda *a, **k: pytest.fail("read"))
    with pytest.raises(images.BadImage, match=r"over the limit of .* \(4096 bytes; --max-file-size"):
        jobs._sample(job, item)
