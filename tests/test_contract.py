"""The contract every format and store keeps, run over {tar, LMDB} x {local, moto's S3, SeaweedFS's S3, Azurite}:
pack, read (every sample once, the source's own bytes), resume, bad data.

An LMDB is written to a local folder only (pack refuses a remote one, saying so); one
copied up to a bucket is read through a whole local copy. The source is 12 small JPEGs,
one of which looks whole but does not decode, so every cell stays quick."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import fsspec.core
import pytest
from conftest import CLASSES, make_folder
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptShardError, LMDBDataset, StreamingDataset
from shardkit.errors import SourceError

from readers import WARNINGS
from resume import check_save_load, into_dataset, resume_state

pytestmark = WARNINGS

BAD = "circle/img_0003.jpg"  # its bytes end as a JPEG's do, but a quantization table it names is missing
KEYS = [f"{i:06d}" for i in range(12)]


class Stored(NamedTuple):
    fmt: str
    url: str
    options: dict[str, Any]  # storage_options and cache_dir, for StreamingDataset and LMDBDataset

    def stream(self, **kw: Any) -> StreamingDataset:
        return StreamingDataset(self.url, **self.options, **kw)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 classes x 4 JPEGs, BAD among them."""
    src = make_folder(tmp_path_factory.mktemp("contract") / "photos", per_class=4)
    whole = (src / BAD).read_bytes()
    dqt = whole.find(b"\xff\xdb") + 4  # the first quantization table's number: 5, of 0 to 3
    (src / BAD).write_bytes(whole[:dqt] + b"\x05" + whole[dqt + 1 :])
    return src


@pytest.fixture(scope="module")
def local(source: Path) -> dict[str, Path]:
    """The source packed into a local folder in each format (the tar one in 3 shards)."""
    for fmt in ("tar", "lmdb"):
        pack(source, str(source.parent / fmt), fmt)
    return {fmt: source.parent / fmt for fmt in ("tar", "lmdb")}


def pack(source: Path, dest: str, fmt: str, **kw: Any) -> shardkit.Index:
    return shardkit.pack(str(source), dest, format=fmt, max_count=5, workers=1, progress=False, **kw)


@pytest.fixture(params=[(f, p) for f in ("tar", "lmdb") for p in ("local", "s3", "seaweedfs", "azure")], ids="-".join)
def stored(request: pytest.FixtureRequest, source: Path, local: dict[str, Path], tmp_path: Path) -> Stored:
    """The packed source where the cell says: packed to the store directly (tar) or copied up (LMDB)."""
    fmt, place = request.param
    if place == "local":
        return Stored(fmt, str(local[fmt]), {})
    remote = request.getfixturevalue(place)
    url, opts = remote["url"] + "/ds", remote["storage_options"]
    if fmt == "tar":
        pack(source, url, fmt, storage_options=opts)
        return Stored(fmt, url, {"storage_options": opts})
    fs, root = fsspec.core.url_to_fs(url, **opts)
    for name in ("data.mdb", "index.json"):
        fs.put(str(local[fmt] / name), f"{root}/{name}")
    return Stored(fmt, url, {"storage_options": opts, "cache_dir": str(tmp_path / "cache")})


def test_what_pack_wrote_verifies(stored: Stored) -> None:
    """Every image indexed (without decode_check the bad one looks whole), every byte as indexed."""
    options = stored.options.get("storage_options")
    idx = shardkit.index.load(stored.url, options)
    assert (idx.kind, idx.samples, idx.skipped) == (stored.fmt, 12, ())
    assert shardkit.verify(stored.url, options) == []


def test_pack_refuses_a_remote_lmdb_saying_so(s3: dict, source: Path) -> None:
    with pytest.raises(SourceError, match=r"^s3://shardkit-test/db: LMDB output must be a local path \(copy it up"):
        pack(source, s3["url"] + "/db", "lmdb", storage_options=s3["storage_options"])


@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_pack_with_decode_check_skips_or_names_the_bad_image(source: Path, tmp_path: Path, fmt: str) -> None:
    skipped = pack(source, str(tmp_path / "checked"), fmt, decode_check=True)
    assert skipped.samples == 11 and [s.path for s in skipped.skipped] == [BAD]
    with pytest.raises(SourceError, match=f"{re.escape(BAD)}: cannot decode image"):
        pack(source, str(tmp_path / "strict"), fmt, decode_check=True, on_error="raise")


def test_every_sample_once_with_the_source_bytes(stored: Stored, source: Path) -> None:
    ds = stored.stream()
    samples = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(ds) == 12 and sorted(s["__key__"] for s in samples) == KEYS
    for s in samples:
        assert s["jpg"] == (source / s["json"]["path"]).read_bytes()
        assert CLASSES[s["cls"]] == s["json"]["class"]
    if stored.fmt == "lmdb":  # random access reads the same samples
        db = LMDBDataset(stored.url, **stored.options)
        assert {db[i]["__key__"]: db[i]["jpg"] for i in range(len(db))} == {s["__key__"]: s["jpg"] for s in samples}


def test_resume(stored: Stored) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def stateful() -> StatefulDataLoader:
        return StatefulDataLoader(stored.stream(shuffle=True), num_workers=2, batch_size=2)

    def plain(workers: int, batch_size: int | None, batching: int | None = None) -> Any:
        return lambda: DataLoader(
            stored.stream(shuffle=True, batch_size=batching), num_workers=workers, batch_size=batch_size
        )

    check_save_load(stateful, 2, same_order=True)  # the loader's own resume: the rest of the very same pass
    elastic = {"save": resume_state(epoch=0), "load": into_dataset, "expected": KEYS}  # into other layouts
    check_save_load([plain(2, 2), plain(1, None)], 2, **elastic)
    check_save_load([plain(2, None, batching=5), plain(0, 3)], 1, **elastic)  # batched in the workers, then not


def test_a_bad_sample_is_named_or_skipped(stored: Stored) -> None:
    (key,) = [s["__key__"] for s in stored.stream() if s["json"]["path"] == BAD]
    where = re.escape(stored.url) + (r"/shard-\d+\.tar" if stored.fmt == "tar" else "")
    with pytest.raises(CorruptShardError, match=rf"^{where}: sample {key}\b.*: field 'jpg': OSError"):
        list(stored.stream(decode="pil"))
    ds = stored.stream(decode="pil", on_error="skip")
    keys = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
    assert len(keys) == len(ds) == 12 and key not in keys and len(set(keys)) == 11
    assert ds.stats()["skipped"] == 1
