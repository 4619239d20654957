"""MapDataset: one map-style dataset over tar shards and LMDB, TarDataset and LMDBDataset
its named forms with the same parameters."""

from __future__ import annotations

import inspect
import pickle
import subprocess
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptShardError, LMDBDataset, MapDataset, TarDataset


def _fields(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k != "__url__"}


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same 30 photos as tar shards and as an LMDB."""
    from conftest import make_folder

    root = tmp_path_factory.mktemp("both")
    src = make_folder(root / "photos")
    shardkit.pack(str(src), str(root / "shards"), max_count=7, workers=1, shuffle=False, progress=False)
    shardkit.pack(str(src), str(root / "db"), format="lmdb", workers=1, shuffle=False, progress=False)
    return root / "shards", root / "db"


def test_one_dataset_reads_either_format_as_its_named_form_does(both: tuple[Path, Path]) -> None:
    shards, db = both
    tar, lmdb = MapDataset(str(shards), decode="rgb8"), MapDataset(str(db), decode="rgb8")
    named_tar, named_lmdb = TarDataset(str(shards), decode="rgb8"), LMDBDataset(str(db), decode="rgb8")
    assert len(tar) == len(lmdb) == len(named_tar) == len(named_lmdb) == 30 and tar.classes == lmdb.classes
    for i in (0, 7, -1):
        assert _fields(tar[i]).keys() == _fields(lmdb[i]).keys()
        assert (tar[i]["jpg"] == named_tar[i]["jpg"]).all() and (lmdb[i]["jpg"] == named_lmdb[i]["jpg"]).all()
        assert (tar[i]["jpg"] == lmdb[i]["jpg"]).all()  # the same photo, whichever format holds it
    assert isinstance(named_tar, MapDataset) and isinstance(named_lmdb, MapDataset)
    assert not isinstance(tar, TarDataset) and named_lmdb.path == str(db)
    with pytest.raises(ValueError, match="an LMDB dataset: read it with LMDBDataset"):
        TarDataset(str(db))
    with pytest.raises(TypeError, match="a MapDataset index must be an integer"):
        tar["1"]  # type: ignore[index]


def test_the_named_forms_take_the_same_parameters(both: tuple[Path, Path]) -> None:
    shards, db = both
    assert inspect.signature(TarDataset) == inspect.signature(LMDBDataset) == inspect.signature(MapDataset)
    for make, source in ((TarDataset, shards), (LMDBDataset, db)):
        ds = make(
            str(source),
            decode="rgb8",
            backend="pil",
            read_threads=2,
            max_member_size="1MB",
            readahead=True,
            cache_limit="1GB",
        )
        assert ds[3]["jpg"].shape[2] == 3 and ds.readahead  # readahead: LMDB's, ignored by tar
        with pytest.raises(ValueError, match="backend"):
            make(str(source), backend="cv2")
        with pytest.raises(TypeError, match="readahead must be True or False"):
            make(str(source), readahead="no")


def test_workers_and_pickles(both: tuple[Path, Path]) -> None:
    for source in both:
        ds = MapDataset(str(source))
        again = pickle.loads(pickle.dumps(ds))
        assert _fields(again[4]) == _fields(ds[4])
        batches = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, collate_fn=lambda b: b)
        seen = sorted(s["__key__"] for b in batches for s in b)
        assert seen == sorted(ds[i]["__key__"] for i in range(30))


def test_gz_fields_of_an_lmdb_are_inflated_and_capped(tmp_path: Path) -> None:
    import webdataset as wds

    (tmp_path / "wds").mkdir()
    with wds.TarWriter(str(tmp_path / "wds" / "a.tar")) as sink:
        sink.write({"__key__": "doc", "json.gz": b'{"boxes": [1, 2]}', "txt.gz": b"x" * 5000})  # gzipped by the writer
    subprocess.run(["shardkit", "index", str(tmp_path / "wds")], check=True, capture_output=True)
    shardkit.pack(str(tmp_path / "wds"), str(tmp_path / "db"), format="lmdb", progress=False)
    assert LMDBDataset(str(tmp_path / "db"))[0]["json.gz"] == {"boxes": [1, 2]}  # as StreamingDataset reads it
    with pytest.raises(CorruptShardError, match=r"db: sample doc: field 'txt.gz': inflates to more than 1000 bytes"):
        LMDBDataset(str(tmp_path / "db"), max_member_size=1000)[0]
