"""Compressed shards and members: formats/gzip.py on bytes in memory, then shards written by\nwebdataset (compress=True) and `tar czf`, read as webdataset reads them."""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import StreamingDataset
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
    for a, b in [
        (100_000, 150_000),
        (10_000, 20_000),
        (0, 5),
        (90_000, 110_000),
        (300_000, 310_000),
        (150_000, 160_000),
        (600_000, 700_000),
        (500_000, 510_000),
    ]:
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


# ------------------------------------------------------------------ compressed shards, read whole


def write_gz(folder: Path, photos: Path, count: int = 23) -> list[str]:
    """Compressed shards as webdataset's ShardWriter writes them (compress=True), with a
    caption and a gzip-compressed json member in each sample; their URLs."""
    import webdataset as wds

    folder.mkdir()
    files = sorted(photos.glob("*/*.jpg"))[:count]
    with wds.ShardWriter(str(folder / "wds-%06d.tar.gz"), maxcount=5, verbose=0, compress=True) as sink:
        for i, f in enumerate(files):
            sink.write(
                {
                    "__key__": f"s{i:04d}",
                    "jpg": f.read_bytes(),
                    "cls": i % 3,
                    "txt": f"caption {i}",
                    "json.gz": {"i": i, "name": f.name},
                }
            )
    return [str(p) for p in sorted(folder.glob("*.tar.gz"))]


def webdataset_decoded(urls: list[str]) -> list[dict]:
    """What webdataset yields with its default decoders (images left as bytes)."""
    import gc
    import warnings

    import webdataset as wds

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        samples = fields_of(wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode())
        gc.collect()
    return samples


def fields_of(samples: Iterable[dict]) -> list[dict]:
    return [{k: v for k, v in s.items() if k == "__key__" or not k.startswith("__")} for s in samples]


def test_webdataset_compressed_shards_read_as_webdataset_reads_them(photos: Path, tmp_path: Path) -> None:
    urls = write_gz(tmp_path / "gz", photos)
    assert len(urls) == 5 and all(is_gzip(Path(u).read_bytes()[:3]) for u in urls)
    expected = webdataset_decoded(urls)
    assert expected[7]["json.gz"] == {"i": 7, "name": "img_0007.jpg"} and expected[7]["txt"] == "caption 7"
    for source in (str(tmp_path / "gz" / "wds-{000000..000004}.tar.gz"), urls, str(tmp_path / "gz")):
        ds = StreamingDataset(source)
        assert len(ds) == 23 and fields_of(ds) == expected
    # indexed once, read by offsets into the inflated stream, shuffled across ranks and workers
    idx = shardkit.build_index(urls)
    assert all(s.compression == "gzip" for s in idx.shards)
    assert [s.bytes for s in idx.shards] == [os.path.getsize(u) for u in urls]  # the compressed files' sizes
    shardkit.index.save(idx, str(tmp_path / "gz"))
    assert fields_of(StreamingDataset(str(tmp_path / "gz"))) == expected
    everything = sorted(s["__key__"] for s in expected)
    seen = []
    for rank in range(2):
        ds = StreamingDataset(str(tmp_path / "gz"), shuffle=True, rank=rank, world_size=2, decode="rgb8")
        got = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
        assert len(got) == len(set(got)) == 12
        seen += got
    assert set(seen) == set(everything)
    assert shardkit.verify(str(tmp_path / "gz")) == []


def test_tar_czf_shards_whatever_their_name(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "files"
    src.mkdir()
    names = []
    for i, f in enumerate(sorted(photos.glob("*/*.jpg"))[:6]):
        (src / f"{i:04d}.jpg").write_bytes(f.read_bytes())
        (src / f"{i:04d}.cls").write_text(str(i % 3))
        (src / f"{i:04d}.json.gz").write_bytes(gzip.compress(json.dumps({"i": i}).encode()))
        names += [f"{i:04d}.cls", f"{i:04d}.jpg", f"{i:04d}.json.gz"]
    (tmp_path / "shards").mkdir()
    subprocess.run(["tar", "czf", str(tmp_path / "shards" / "a.tgz"), "-C", str(src), *names[:9]], check=True)
    subprocess.run(
        ["tar", "czf", str(tmp_path / "shards" / "b.tar"), "-C", str(src), *names[9:]], check=True
    )  # gzip inside
    urls = [str(tmp_path / "shards" / n) for n in ("a.tgz", "b.tar")]
    expected = webdataset_decoded(urls)
    assert [s["json.gz"] for s in expected] == [{"i": i} for i in range(6)]
    assert fields_of(StreamingDataset(urls)) == expected
    result = subprocess.run(
        [sys.executable, "-m", "shardkit", "index", str(tmp_path / "shards")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "indexed 6 samples in 2 shards" in result.stdout
    assert fields_of(StreamingDataset(str(tmp_path / "shards"))) == expected
    info = subprocess.run(
        [sys.executable, "-m", "shardkit", "info", str(tmp_path / "shards")], capture_output=True, text=True, check=True
    ).stdout
    assert "compressed: 2 of 2 shards (gzip: read as streams, no random access)" in info


def test_compressed_shards_in_a_bucket(s3: dict, photos: Path, tmp_path: Path) -> None:
    urls = write_gz(tmp_path / "gz", photos)
    expected = webdataset_decoded(urls)
    opts = s3["storage_options"]
    for u in urls:
        shardkit.storage.write_bytes_atomic(s3["url"] + "/gz/" + Path(u).name, Path(u).read_bytes(), opts)
    ds = StreamingDataset(s3["url"] + "/gz", storage_options=opts, prefetch=4)
    assert fields_of(ds) == expected
    loader = DataLoader(
        StreamingDataset(s3["url"] + "/gz", storage_options=opts, shuffle=True), batch_size=None, num_workers=2
    )
    assert sorted(s["__key__"] for s in loader) == sorted(s["__key__"] for s in expected)


def test_decompression_bombs_are_refused(tmp_path: Path) -> None:
    import tarfile

    with tarfile.open(tmp_path / "bomb.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("x.bin")
        info.size = 20 << 20
        tar.addfile(info, io.BytesIO(bytes(info.size)))  # 20 MB of zeros, ~20 KB compressed
    assert os.path.getsize(tmp_path / "bomb.tar.gz") < 100_000
    message = (
        r"bomb.tar.gz: sample 0 inflates to 20972032 bytes \(at byte 0 of its tar\), over max_member_size \(1048576 "
    )
    with pytest.raises(CorruptShardError, match=message):
        list(StreamingDataset(str(tmp_path / "bomb.tar.gz"), max_member_size="1MiB"))
    assert len(list(StreamingDataset(str(tmp_path / "bomb.tar.gz")))) == 1  # under the default cap
    (tmp_path / "gzm").mkdir()
    with tarfile.open(tmp_path / "gzm" / "a.tar", "w") as tar:
        data = gzip.compress(bytes(20 << 20))
        info = tarfile.TarInfo("k.txt.gz")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(
        CorruptShardError, match=r"a.tar: sample k: field 'txt.gz': inflates to more than 1048576 bytes"
    ):
        list(StreamingDataset(str(tmp_path / "gzm" / "a.tar"), max_member_size=1 << 20))


def test_a_damaged_compressed_shard_is_named(photos: Path, tmp_path: Path) -> None:
    urls = write_gz(tmp_path / "gz", photos)
    shardkit.index.save(shardkit.build_index(urls), str(tmp_path / "gz"))
    data = bytearray(Path(urls[2]).read_bytes())
    Path(urls[2]).write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CorruptShardError, match=r"wds-000002.tar.gz: cut off inside its gzip stream"):
        list(StreamingDataset(str(tmp_path / "gz")))
    problems = shardkit.verify(str(tmp_path / "gz"))
    assert len(problems) == 1 and "wds-000002.tar.gz" in problems[0]


@pytest.mark.parametrize("remote", [False, True])
def test_converting_compressed_shards_gives_random_access(
    photos: Path, tmp_path: Path, s3: dict, remote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From local disk or a bucket (where each compressed shard is downloaded once, though
    several jobs read it)."""
    urls = write_gz(tmp_path / "gz", photos)
    shardkit.index.save(shardkit.build_index(urls), str(tmp_path / "gz"))
    src, opts = str(tmp_path / "gz"), None
    if remote:
        src, opts = s3["url"] + "/gz", s3["storage_options"]
        for f in (tmp_path / "gz").iterdir():
            shardkit.storage.write_bytes_atomic(f"{src}/{f.name}", f.read_bytes(), opts)
    opened: list[str] = []
    open_read = shardkit.storage.open_read
    monkeypatch.setattr(
        shardkit.storage, "open_read", lambda url, *a, **k: (opened.append(url), open_read(url, *a, **k))[1]
    )
    idx = shardkit.pack(
        src, str(tmp_path / "plain"), max_count=4, workers=1 if remote else 2, progress=False, storage_options=opts
    )  # (one process: the one counting what it opens)
    assert idx.samples == 23 and all(s.compression is None for s in idx.shards)
    ds = shardkit.TarDataset(str(tmp_path / "plain"))
    assert fields_of(ds[i] for i in range(len(ds))) == webdataset_decoded(urls)
    if remote:
        assert sorted(u for u in opened if u.endswith(".gz")) == sorted(f"{src}/{Path(u).name}" for u in urls)


@pytest.mark.parametrize("remote", [False, True])
def test_a_shuffled_pass_inflates_each_compressed_shard_once(
    photos: Path, tmp_path: Path, s3: dict, remote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = write_gz(tmp_path / "gz", photos, count=30)
    opts = s3["storage_options"] if remote else None
    if remote:
        for i, u in enumerate(urls):
            urls[i] = s3["url"] + "/gz/" + Path(u).name
            shardkit.storage.write_bytes_atomic(urls[i], Path(u).read_bytes(), opts)
    starts = []
    restart = Ranges._restart
    monkeypatch.setattr(Ranges, "_restart", lambda self: (starts.append(self), restart(self)))
    ds = StreamingDataset(urls, shuffle=True, shuffle_window=16, block=2, storage_options=opts, prefetch=4)
    for epoch in range(2):
        ds.set_epoch(epoch)
        keys = [s["__key__"] for s in ds]
        assert sorted(keys) == [f"s{i:04d}" for i in range(30)] and keys != sorted(keys)
        assert len(starts) == 6 * (epoch + 1)  # a stream per shard and pass: none started twice
