"""Bad data and failing reads: truncated, damaged and undecodable shards, named; on_error="skip"."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import make_folder, shard_offsets
from PIL import Image
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptShardError
from shardkit.errors import ShardkitError
from shardkit.reading.dataset import StreamingDataset

from readers import WARNINGS, break_image, failure, pack, run, sample_span
from resume import check_save_load, into_iterator, iterator_state

pytestmark = WARNINGS


def test_a_shard_replaced_during_a_run_is_caught_range_by_range(packed: Path, tmp_path: Path) -> None:
    """A repack into the same place while a dataset built on the old index reads on: the
    shard's fingerprint is not the index's, named as the shard is first opened (its sample
    ranges no longer hold whole samples); skipped whole under on_error="skip"."""
    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    ds = StreamingDataset(str(copy), on_error="skip")
    strict, verified = StreamingDataset(str(copy)), StreamingDataset(str(copy), verify=True)
    shutil.copyfile(packed / "shard-000002.tar", copy / "shard-000001.tar")  # other images: other sizes
    with pytest.raises(CorruptShardError, match=r"shard-000001\.tar: changed since its index was made"):
        list(strict)
    with pytest.raises(CorruptShardError, match=r"shard-000001\.tar.*sha256"):
        list(verified)
    keys = [s["__key__"] for s in ds]
    assert len(keys) == len(ds) and 0 < ds.stats()["skipped"] <= 7


def test_truncated_shard_names_the_file(packed: Path, tmp_path: Path) -> None:
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    shard = clone / "shard-000003.tar"
    os.truncate(shard, shard.stat().st_size // 2)
    for workers in (0, 2):
        err = failure(StreamingDataset(str(clone)), workers)
        assert isinstance(err, CorruptShardError) and "shard-000003.tar" in str(err)


def test_scan_messages_name_absolute_positions(packed: Path, tmp_path: Path) -> None:
    """verify on a shard cut inside a member's padding says so (not '1 of 1 bytes
    truncated'); a damaged header read through a sample's range names the member by its
    byte in the shard, as the sample is (not 'sample at byte N at byte 0')."""
    from shardkit import verify

    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    shard = clone / "shard-000001.tar"
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-1]
    os.truncate(shard, last.offset_data + last.size + 1)  # the data whole, its padding cut
    (problem,) = verify(str(clone))
    assert f"member {last.name!r} cut off at byte {last.offset_data + last.size + 1} (its padding: 1 of " in problem
    shutil.copy(packed / shard.name, shard)
    start = shard_offsets(clone)["shard-000002.tar"][3]
    data = bytearray((clone / "shard-000002.tar").read_bytes())
    data[start + 257 : start + 263] = b"xxxxxx"  # the ustar magic: off the fast path, into the checked one
    (clone / "shard-000002.tar").write_bytes(bytes(data))
    err = failure(StreamingDataset(str(clone)), 0)
    assert f"shard-000002.tar (sample at byte {start}), member at byte {start}: " in str(err), err


def test_offsets_that_do_not_fit_their_shard_fail_naming_it(packed: Path, tmp_path: Path) -> None:
    """A sidecar is mapped, not read whole: offsets that cannot be their shard's (a file
    damaged or replaced) fail before the first read, in the pass that would use them."""
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    side = clone / shardkit.index.load(str(clone)).offsets_file.file
    table = np.load(side)
    table[3 * 8 + 2] = 10**9  # shard 3's sample 2 ends far past its shard (each shard: 7 samples, 8 offsets)
    np.save(side, table)
    ds = StreamingDataset(str(clone))
    with pytest.raises(
        CorruptShardError,
        match=r"shard-000003.tar: the index's offsets put a sample at bytes "
        r"\d+-1000000000 of the shard's \d+$",
    ):
        list(ds)


def test_member_names_that_are_not_utf8_are_named_errors(tmp_path: Path) -> None:
    """Another tool's tar may carry Latin-1 names: the scan and the indexed fast path both
    say which shard and member, instead of a bare UnicodeDecodeError; an empty file is no
    tar (a failed copy), and a pax record that would loop is refused."""
    folder = tmp_path / "latin"
    folder.mkdir()
    with tarfile.open(folder / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("ok_.jpg", "ok_.cls"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"123"))
    shardkit.index.save(shardkit.build_index(str(folder / "a.tar")), str(folder))
    data = bytearray((folder / "a.tar").read_bytes())
    data[2] = 0xE9  # "ok\xe9.jpg": Latin-1 for "oké.jpg", and the header's checksum to match
    data[148:156] = b"%06o\0 " % (sum(data[:148]) + sum(data[156:512]) + 8 * ord(" "))
    (folder / "a.tar").write_bytes(bytes(data))
    err = failure(StreamingDataset(str(folder)), 0)
    assert isinstance(err, CorruptShardError) and re.search(
        r"a\.tar \(sample at byte 0\): the member at byte 0 of the "
        r"sample has a name that is not UTF-8",
        str(err),
    ), err
    with pytest.raises(CorruptShardError, match=r"a\.tar, member at byte 0: its name b'ok\\xe9\.jpg' is not UTF-8"):
        shardkit.build_index(str(folder / "a.tar"))
    (folder / "b.tar").write_bytes(b"")
    with pytest.raises(CorruptShardError, match=r"b\.tar: an empty file \(0 bytes\), not a tar archive"):
        shardkit.build_index(str(folder / "b.tar"))
    pax = b"0 path=x\n"  # a record length of 0 would never move on
    with tarfile.open(folder / "c.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("PaxHeader")
        info.type, info.size = tarfile.XHDTYPE, len(pax)
        tar.addfile(info, io.BytesIO(pax))
    with pytest.raises(CorruptShardError, match=r"c\.tar, member at byte 0: a malformed pax header record at byte 0"):
        shardkit.build_index(str(folder / "c.tar"))


def test_members_of_a_sample_apart_are_refused_by_the_scan(photos: Path, tmp_path: Path) -> None:
    """`tar cf` in directory order can put a.jpg, b.jpg, a.cls: webdataset makes two half
    samples of `a`; the scan of an index-less shard says what is wrong instead."""
    shard = tmp_path / "plain.tar"
    with tarfile.open(shard, "w") as tar:
        for name in ("a.jpg", "b.jpg", "a.cls", "b.cls"):
            tar.add(photos / "circle" / "img_0000.jpg", name)
    with pytest.raises(
        CorruptShardError,
        match=r"plain\.tar: the members of sample 'a' are not adjacent \(more of them "
        r"at byte \d+\).*`tar --sort=name`",
    ):
        StreamingDataset(str(shard))
    with tarfile.open(shard, "w") as tar:  # a sample repeated whole (tars concatenated): read as webdataset does
        for name in ("a.jpg", "a.bin", "b.jpg", "b.bin", "a.jpg", "a.bin"):
            tar.add(photos / "circle" / "img_0000.jpg", name)
    assert [s["__key__"] for s in StreamingDataset(str(shard))] == ["a", "b", "a"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["first member", "image", "after the image"])
def test_truncated_shard_skipped_sample_by_sample(packed: Path, tmp_path: Path, workers: int, where: str) -> None:
    """Under on_error="skip" a cut-off shard loses only the samples past the cut; the rest
    are read, the lost ones replaced and counted. The error says where the shard ends,
    wherever the cut is in the sample (cls, jpg, json members)."""
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    idx = json.loads((clone / "index.json").read_text())
    shard = idx["shards"][3]
    start = shard_offsets(clone)[shard["name"]][2]
    _, image, size, _ = sample_span(clone, 3, 2, "jpg")
    with tarfile.open(clone / shard["name"]) as tar:
        member = [n for n in tar.getnames() if n.endswith(".jpg")][2]
    cut, said = {
        "first member": (start + 700, "cut off, the shard ends at byte {cut}"),
        "image": (image + 100, "cut off in member '{member}', the shard ends at byte {cut}"),
        "after the image": (image + size + (-size % 512), "cut off, the shard ends at or before byte {cut}"),
    }[where]
    os.truncate(clone / shard["name"], cut)
    ds = StreamingDataset(str(clone), on_error="skip")
    keys = run(ds, workers)
    lost = shard["samples"] - 2
    assert len(keys) == len(ds) == 120 and len(set(keys)) == 120 - lost
    assert ds.stats()["skipped"] == lost
    err = failure(StreamingDataset(str(clone)), workers)
    assert isinstance(err, CorruptShardError)
    assert f"{shard['name']} (sample at byte {start}): {said.format(cut=cut, member=member)} (truncated" in str(err)


def test_a_worker_logs_its_first_ten_skips(packed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    for name in ("shard-000001.tar", "shard-000002.tar"):
        os.truncate(clone / name, 0)
    ds = StreamingDataset(str(clone), on_error="skip")
    with caplog.at_level("WARNING", logger="shardkit"):
        assert len(list(ds)) == 120
    said = [r.getMessage() for r in caplog.records if r.name == "shardkit"]
    assert ds.stats()["skipped"] > 10 and len(said) == 10
    assert all(m.startswith("skipped ") and "cut off" in m for m in said)
    assert said[-1].endswith("(this worker's further skips are counted in stats() only)")


def test_a_shard_truncated_while_read_raises(packed: Path, tmp_path: Path) -> None:
    """A shard cut short in the middle of a pass (rewritten in place by a sync job) raises
    CorruptShardError naming it; a reader of memory maps would die of SIGBUS instead."""
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    stream = iter(StreamingDataset(str(clone)))
    assert next(stream)["__key__"]
    os.truncate(clone / "shard-000000.tar", 1024)
    with pytest.raises(CorruptShardError, match=r"shard-000000\.tar \(sample at byte \d+\): cut off"):
        for _ in stream:
            pass


def test_a_read_error_is_not_skipped_as_bad_data(packed: Path, tmp_path: Path) -> None:
    """A shard that cannot be read (here a folder in its place: pread fails with EISDIR, as a
    failing disk fails with EIO) stops the pass, naming the shard, even under on_error="skip":
    skipping is for bad samples, not for storage that fails."""
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    (clone / "shard-000003.tar").unlink()
    (clone / "shard-000003.tar").mkdir()
    for workers in (0, 2):
        err = failure(StreamingDataset(str(clone), on_error="skip"), workers)
        assert type(err) is ShardkitError, err
        assert "shard-000003.tar: reading bytes" in str(err) and "IsADirectoryError" in str(err)


@pytest.fixture
def broken(photos: Path, tmp_path: Path) -> tuple[Path, str, str]:
    """30 samples in shards of 4; the JPEG of sample 1 of shard 2 is garbage."""
    dataset = pack(photos, tmp_path / "shards", max_count=4)
    shard, key = break_image(dataset, 2, 1)
    return dataset, shard, key


def test_undecodable_image_raises_naming_the_shard_sample_source_and_fix(broken: tuple[Path, str, str]) -> None:
    """The shard, the sample, the file it was packed from (its json) and how to get past it."""
    dataset, shard, key = broken
    assert len(run(StreamingDataset(str(dataset)), 0)) == 30  # raw bytes are not decoded
    for workers in (0, 2):
        err = failure(StreamingDataset(str(dataset), decode="pil"), workers)
        said = str(err).splitlines()[-1]  # a worker's error comes back with its traceback
        assert isinstance(err, CorruptShardError), err
        assert re.search(
            rf"{re.escape(shard)}: sample {key} at byte \d+ \(packed from \w+/img_\d+\.jpg\): field 'jpg': "
            r"UnidentifiedImageError: .*; on_error=\"skip\" leaves bad samples out; `shardkit verify "
            r"--decode` lists every bad sample, `shardkit pack --decode-check` keeps them out of a pack$",
            said,
        ), said


@pytest.mark.parametrize("workers", [0, 2])
def test_undecodable_image_skipped_keeps_the_count(
    broken: tuple[Path, str, str], workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    dataset, shard, key = broken
    ds = StreamingDataset(str(dataset), decode="pil", on_error="skip")
    samples = list(DataLoader(ds, num_workers=workers, batch_size=None))
    keys = [s["__key__"] for s in samples]
    assert len(keys) == len(ds) == 30
    assert key not in keys and len(set(keys)) == 29
    assert all(isinstance(s["jpg"], Image.Image) for s in samples)
    assert ds.stats()["skipped"] == 1
    if not workers:  # named in a warning too (a worker's go to its stderr)
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardkit"):
            list(ds)
        (said,) = [r.getMessage() for r in caplog.records if r.name == "shardkit"]
        assert re.match(
            rf"skipped \S+{re.escape(shard)}: sample {key} at byte \d+ \(packed from \w+/img_\d+\.jpg\): "
            "field 'jpg': ",
            said,
        ), said
    # under two ranks as well: both ranks still yield len(ds)
    per_rank, skipped = [], 0
    for rank in range(2):
        ds = StreamingDataset(str(dataset), decode="pil", on_error="skip", shuffle=True, rank=rank, world_size=2)
        per_rank.append(run(ds, workers))
        skipped += ds.stats()["skipped"]
        assert len(per_rank[-1]) == len(ds) == 15
    assert skipped == 1
    assert set(per_rank[0]) | set(per_rank[1]) == {f"{i:06d}" for i in range(30)} - {key}


def test_image_transform_finds_bad_data_as_decode_does(broken: tuple[Path, str, str], tmp_path: Path) -> None:
    """The quickstart's path (decode="raw", image_transform decoding in the transform): an
    undecodable image is named with its shard and sample, and skipped under on_error="skip",
    as with decode="pil"; a bug in the user's own transform is still the user's own error."""
    from shardkit import LMDBDataset
    from shardkit.decode import image_transform

    dataset, shard, key = broken
    augment = image_transform(16, crop=None)
    for workers in (0, 2):
        err = failure(StreamingDataset(str(dataset), transform=augment), workers)
        assert isinstance(err, CorruptShardError) and f"{shard}: sample {key} at byte" in str(err)
        assert "field 'jpg': UnidentifiedImageError: cannot identify an image format in " in str(err)
        assert re.search(r"\d+ bytes starting b'not a jp'", str(err)) and "BytesIO" not in str(err), err
    ds = StreamingDataset(str(dataset), transform=augment, on_error="skip")
    assert len(list(ds)) == 30 and ds.stats()["skipped"] == 1
    # the shard's index entry re-made over the bad bytes, which a conversion then copies (it skips a shard that
    # does not match its index)
    shardkit.index.save(shardkit.build_index(sorted(str(p) for p in dataset.glob("*.tar"))), str(dataset))
    shardkit.pack(str(dataset), str(tmp_path / "db"), format="lmdb", progress=False)
    with pytest.raises(
        CorruptShardError,
        match=rf"db: sample {key} \(packed from \w+/img_\d+\.jpg\): field 'jpg': "
        r"UnidentifiedImageError: .*; `shardkit verify --decode` lists every bad sample",
    ):
        [x for x in LMDBDataset(str(tmp_path / "db"), transform=augment)]

    def buggy(sample: dict) -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        next(iter(StreamingDataset(str(dataset), transform=buggy, on_error="skip")))


def test_skip_keeps_the_count_when_a_worker_has_only_bad_samples(tmp_path: Path) -> None:
    dataset = pack(make_folder(tmp_path / "photos", per_class=1), tmp_path / "shards")
    _, key = break_image(dataset, 0, 1)
    ds = StreamingDataset(str(dataset), decode="pil", on_error="skip")
    keys = run(ds, 3)  # one sample per worker: worker 1 has only the broken one
    assert ds.stats()["skipped"] == 1
    assert len(keys) == len(ds) == 3


def test_skip_then_resume_yields_what_one_pass_yields(tmp_path: Path) -> None:
    """Bad samples at the end of a worker's plan get the same stand-in whether or not the
    pass was resumed just before them."""
    dataset = pack(make_folder(tmp_path / "photos", per_class=3), tmp_path / "shards", shuffle=False)
    break_image(dataset, 0, 7)
    break_image(dataset, 0, 8)

    def dataset_of_keys() -> StreamingDataset:
        return StreamingDataset(str(dataset), decode="pil", on_error="skip", transform=lambda s: s["__key__"])

    resumed = check_save_load(
        dataset_of_keys, 7, save=iterator_state, load=into_iterator, keys=lambda key: [key], same_order=True
    )
    assert sum(map(len, resumed.pieces)) == 9


def test_verify_names_a_shard_whose_checksum_is_wrong(tmp_path: Path, packed: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    shard = copy / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0x20  # inside the first sample's cls payload region: still parses
    shard.write_bytes(bytes(data))
    assert len(list(StreamingDataset(str(copy)))) == 120  # unnoticed without verify
    with pytest.raises(CorruptShardError, match=r"shard-000002\.tar: sha256 mismatch"):
        list(StreamingDataset(str(copy), verify=True))


def test_a_bad_shard_is_hashed_once_and_leaks_no_descriptor(tmp_path: Path, packed: Path) -> None:
    import os
    import shutil

    from shardkit import storage

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    shard = copy / "shard-000000.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0x20
    shard.write_bytes(bytes(data))
    ds = StreamingDataset(str(copy))
    reader = storage.RangeReader(ds.urls, None, [s.sha256 for s in ds.index.shards], verify=True)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(CorruptShardError, match="sha256 mismatch"):
            reader.read(0, 0, 512)
    reader.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_the_stand_in_for_bad_samples_leaves_transform_errors_alone(tmp_path: Path) -> None:
    """on_error="skip" skips bad data, never the user's own exceptions, even where a stand-in
    sample is searched for (a plan with only bad samples left)."""
    dataset = pack(make_folder(tmp_path / "photos", per_class=1), tmp_path / "shards")
    break_image(dataset, 0, 1)

    def boom(sample: dict[str, Any]) -> Any:
        raise KeyError("a bug in the transform")

    ds = StreamingDataset(
        str(dataset), decode="pil", on_error="skip", transform=boom, rank=1, world_size=3, remainder="drop"
    )  # rank 1's only sample is the broken one
    with pytest.raises(KeyError, match="a bug in the transform"):
        run(ds)
