"""LMDB: packing, conversion both ways, random access, streaming, resume, bad input."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import shardkit
from shardkit import LMDBDataset, StreamingDataset
from shardkit.errors import CorruptShardError, DatasetNotFoundError, ShardkitError
from shardkit.formats import lmdb as lmdb_format
from shardkit.formats import lmdb_cold_reads, lmdb_envs, lmdb_records, lmdb_writer

from conftest import ROOT, kill_group, make_folder
from readers import loader_of
from resume import check_save_load, into_dataset, resume_state
from test_pack import read_shards


def records(path: Path) -> dict[bytes, bytes]:
    with lmdb_format.open_reader(str(path)).begin() as txn:  # one environment per process and path
        return {bytes(k): bytes(v) for k, v in txn.cursor()}


def keys_of(batch: list[dict]) -> list[str]:
    return [s["__key__"] for s in batch]


@pytest.fixture
def lmdb_pack(photos: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "photos.lmdb"
    shardkit.pack(str(photos), str(dest), format="lmdb", max_count=4, workers=2, progress=False)
    return dest


def test_pack_stores_every_member_byte_for_byte(photos: Path, lmdb_pack: Path) -> None:
    recs = records(lmdb_pack)
    index = json.loads(recs[b"__index__"])
    assert index["kind"] == "lmdb" and index["samples"] == 30 and len(index["keys"]) == 30
    for key in index["keys"]:
        meta = json.loads(recs[f"{key}.json".encode()])
        assert recs[f"{key}.jpg".encode()] == (photos / meta["path"]).read_bytes()
        assert int(recs[f"{key}.cls".encode()]) == index["classes"].index(meta["class"])
    assert not any(k.startswith(b"__progress__") for k in recs)
    assert json.loads((lmdb_pack / "index.json").read_text())["keys"] == index["keys"]


def test_readme_plain_lmdb_example_runs(lmdb_pack: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"<!-- plain-lmdb -->\n```python\n(.*?)```", readme, re.S).group(1)
    assert len(code.strip().splitlines()) <= 6
    scope: dict = {}
    cwd = os.getcwd()
    os.chdir(lmdb_pack.parent)
    try:
        exec(code, scope)
    finally:
        os.chdir(cwd)
    assert isinstance(scope["image"], bytes) and scope["image"][:3] == b"\xff\xd8\xff"
    assert scope["label"] in (0, 1, 2)


def test_deterministic_content_whatever_the_workers(photos: Path, tmp_path: Path) -> None:
    shardkit.pack(str(photos), str(tmp_path / "a"), format="lmdb", max_count=3, workers=1, progress=False)
    shardkit.pack(str(photos), str(tmp_path / "b"), format="lmdb", max_count=3, workers=3, progress=False)
    assert records(tmp_path / "a") == records(tmp_path / "b")


def test_round_trip_tar_lmdb_tar_is_byte_identical(photos: Path, tmp_path: Path) -> None:
    shardkit.pack(str(photos), str(tmp_path / "tar1"), max_count=7, max_size=None, workers=2, progress=False)
    shardkit.pack(str(tmp_path / "tar1"), str(tmp_path / "db"), format="lmdb", workers=2, progress=False)
    shardkit.pack(str(tmp_path / "db"), str(tmp_path / "tar2"), max_count=7, max_size=None, workers=2, progress=False)
    one, two = sorted((tmp_path / "tar1").glob("*.tar")), sorted((tmp_path / "tar2").glob("*.tar"))
    assert [p.name for p in one] == [p.name for p in two]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two))
    assert read_shards(tmp_path / "tar1") == read_shards(tmp_path / "tar2")


def test_conversions_keep_the_list_of_skipped_files(photos: Path, tmp_path: Path) -> None:
    (photos / "circle" / "broken.jpg").write_bytes(b"not an image")
    first = shardkit.pack(str(photos), str(tmp_path / "tar1"), workers=1, progress=False)
    db = shardkit.pack(str(tmp_path / "tar1"), str(tmp_path / "db"), format="lmdb", workers=1, progress=False)
    again = shardkit.pack(
        str(tmp_path / "db"), str(tmp_path / "tar2"), workers=1, progress=False, on_error="raise"
    )  # what the first pack skipped is no failure of this one
    assert first.skipped == db.skipped == again.skipped and [s.path for s in first.skipped] == ["circle/broken.jpg"]


def test_map_grows_instead_of_failing(photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lmdb_writer, "_INITIAL_MAP", 64 << 10)  # far smaller than the data
    idx = shardkit.pack(str(photos), str(tmp_path / "db"), format="lmdb", workers=1, progress=False)
    assert idx.samples == 30 and len(LMDBDataset(str(tmp_path / "db"))) == 30


def test_kill_then_rerun_finishes_the_same_database(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", per_class=80)
    ref = tmp_path / "ref"
    shardkit.pack(str(src), str(ref), format="lmdb", max_count=2, workers=1, progress=False)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "pack",
        str(src),
        str(out),
        "--format",
        "lmdb",
        "--max-count",
        "2",
        "--workers",
        "2",
        "-q",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True)
    while proc.poll() is None and not (out / "data.mdb").exists():
        time.sleep(0.001)
    time.sleep(0.1)
    kill_group(proc)
    total = json.loads(records(ref)[b"__index__"])["samples"]
    kept = 0
    if (out / "data.mdb").exists():
        if b"__index__" in records(out):  # it finished before the kill: all of it stays
            kept = total
        else:  # killed mid-way: never taken for finished
            with pytest.raises(shardkit.UnfinishedPackError):
                LMDBDataset(str(out))
            kept = 2 * json.loads(records(out).get(b"__progress__", b'{"chunks": 0}'))["chunks"]
    stats: dict[str, int] = {}
    shardkit.pack(str(src), str(out), format="lmdb", max_count=2, workers=2, progress=False, stats=stats)
    assert records(out) == records(ref)
    assert stats["kept"] == kept and stats["written"] == total - kept  # committed work stays


def test_lmdb_dataset_with_shuffle_workers_and_samplers(lmdb_pack: Path) -> None:
    ds = LMDBDataset(str(lmdb_pack), decode="tensor", transform=None)
    assert len(ds) == 30 and ds[0]["jpg"].dtype.is_floating_point is False and ds[-1]["__key__"] == ds[29]["__key__"]
    with pytest.raises(IndexError):
        ds[30]
    assert ds[np.int64(3)]["__key__"] == ds[torch.tensor(3)]["__key__"] == ds[3]["__key__"]  # samplers' ints
    for bad in (1.0, True, "1", np.True_, torch.tensor(True), torch.tensor([3]), np.array([3])):
        with pytest.raises(TypeError, match="an LMDBDataset index must be an integer"):
            ds[bad]
    for options, message in (
        ({"transform": 5}, "transform must be a function (or None), not 5"),
        ({"readahead": "no"}, "readahead must be True or False, not 'no'"),
        ({"storage_options": 5}, "storage_options must be a dict (or None), not 5"),
    ):
        with pytest.raises(TypeError, match=re.escape(message)):
            LMDBDataset(str(lmdb_pack), **options)
    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, persistent_workers=True, collate_fn=keys_of)
    for _ in range(2):
        keys = [k for b in loader for k in b]
        assert sorted(keys) == sorted(set(keys)) and len(keys) == 30
    halves = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True)
        halves.append(
            [k for b in DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=keys_of) for k in b]
        )
    assert len(halves[0]) == len(halves[1]) == 15 and set(halves[0]) | set(halves[1]) == set(
        ds[i]["__key__"] for i in range(30)
    )


def note_touches(monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    """Log each touch_one call as 'thread key' (in DataLoader workers too: a file)."""
    touch_one = lmdb_format.touch_one

    def noted(env, key: str) -> None:  # type: ignore[no-untyped-def]
        import threading

        with open(log, "a") as f:
            f.write(f"{threading.current_thread().name.split('_')[0]} {key}\n")
        touch_one(env, key)

    monkeypatch.setattr(lmdb_format, "touch_one", noted)


@pytest.mark.parametrize("cold", [False, True])
def test_a_batch_is_read_on_threads_and_comes_back_in_order(
    lmdb_pack: Path, cold: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DataLoader hands a batch's indices to __getitems__. In a worker, once a read waited
    for the disk (here: every read, when `cold`) threads fault the rest of the batch in at
    once, and this thread reads (copies) each as soon as it is in. Either way the samples
    come back in the batch's order, exactly as one at a time; the process you train in never
    starts threads."""
    # every read waits for the disk when `cold` (slow, with a major fault), none otherwise
    monkeypatch.setattr(lmdb_cold_reads, "COLD_READ_S", -1.0 if cold else 60.0)
    monkeypatch.setattr(lmdb_cold_reads, "major_faults", itertools.count().__next__)
    log = tmp_path / "touched"
    note_touches(monkeypatch, log)
    ds = LMDBDataset(str(lmdb_pack), read_threads=8)
    order = [29, 0, 17, 3, 3, -1, 12]
    one_by_one = [ds[i] for i in order]
    for _ in range(3):
        lmdb_format.close_reader(str(lmdb_pack))
        assert ds.__getitems__(order) == one_by_one
    assert ds._threads is None and not log.exists()
    for _ in range(3):
        batch = next(iter(DataLoader(ds, batch_size=7, sampler=order, num_workers=1, collate_fn=lambda b: b)))
        assert batch == one_by_one
    touched = log.read_text().split("\n")[:-1] if log.exists() else []
    assert sorted(touched) == sorted(f"shardkit-lmdb {s['__key__']}" for s in one_by_one[1:] * 3 if cold)
    assert LMDBDataset(str(lmdb_pack), read_threads=1).__getitems__(order) == one_by_one
    with pytest.raises(IndexError):
        ds.__getitems__([1, 30])
    with pytest.raises(ValueError, match="read_threads"):
        LMDBDataset(str(lmdb_pack), read_threads=0)


def test_threads_opening_the_environment_at_once_open_it_once(lmdb_pack: Path) -> None:
    """LMDB allows one environment per file and process: reading threads racing to open it
    must share one (the lock in open_reader)."""
    from concurrent.futures import ThreadPoolExecutor

    ds = LMDBDataset(str(lmdb_pack))
    with ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            lmdb_format.close_reader(str(lmdb_pack))
            assert [s["__key__"] for s in pool.map(ds._read, range(30))] == [ds[i]["__key__"] for i in range(30)]


class WithIndex(LMDBDataset):
    def __getitem__(self, i: int) -> dict:
        return {**super().__getitem__(i), "idx": i}


def frozen_objects(sample: dict) -> int:
    import gc

    return gc.get_freeze_count()


def test_subclasses_and_workers_after_a_read_in_the_main_process(lmdb_pack: Path) -> None:
    """A subclass's own __getitem__ is used for batches too; a worker forked after the main
    process read a sample still freezes what it inherited (see shardkit/worker.py)."""
    sub = WithIndex(str(lmdb_pack))
    assert [
        s["idx"] for b in DataLoader(sub, batch_size=4, sampler=[5, 1, 9, 2], collate_fn=lambda b: b) for s in b
    ] == [5, 1, 9, 2]
    ds = LMDBDataset(str(lmdb_pack), transform=frozen_objects)
    before = ds[0]
    counts = [int(c) for b in DataLoader(ds, batch_size=4, num_workers=1) for c in b]
    assert min(counts) > 10_000 and ds[1] == before
    owned = [
        bool(o)
        for b in DataLoader(LMDBDataset(str(lmdb_pack), transform=own_environment), batch_size=4, num_workers=2)
        for o in b
    ]
    assert len(owned) == 30 and all(owned)  # never the environment inherited through fork


def own_environment(sample: dict) -> bool:
    return bool(lmdb_envs._ENVS) and all(e.pid == os.getpid() for e in lmdb_envs._ENVS)


def test_streaming_over_lmdb_from_a_cold_cache_reads_on_threads(
    lmdb_pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read counted as slow (as from a cold page cache): the rest of each window is
    read on threads, and the stream is the same, sample for sample, as one read at a time."""

    def stream(**kw):  # type: ignore[no-untyped-def]
        ds = StreamingDataset(str(lmdb_pack), shuffle=True, seed=4, **kw)
        return [(s["__key__"], s["jpg"]) for w in (0, 2) for s in DataLoader(ds, batch_size=None, num_workers=w)]

    serial = stream(prefetch=0)
    monkeypatch.setattr(lmdb_cold_reads, "COLD_READ_S", -1.0)
    monkeypatch.setattr(lmdb_cold_reads, "major_faults", itertools.count().__next__)
    assert stream(prefetch=4) == serial and len(serial) == 60
    log = tmp_path / "touched"
    note_touches(monkeypatch, log)
    keys = [s["__key__"] for s in StreamingDataset(str(lmdb_pack), prefetch=4)]
    assert sorted(log.read_text().split("\n")[:-1]) == sorted(f"shardkit-lmdb {k}" for k in keys[1:])  # one window


def test_streaming_over_lmdb_keeps_the_guarantees(lmdb_pack: Path) -> None:
    all_keys = set()
    counts = []
    for rank in range(4):
        ds = StreamingDataset(str(lmdb_pack), shuffle=True, rank=rank, world_size=4, decode="pil")
        keys = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
        assert len(keys) == len(set(keys)) == len(ds) == 8
        counts.append(len(keys))
        all_keys |= set(keys)
    assert len(all_keys) == 30 and counts == [8, 8, 8, 8]
    first, then = (
        loader_of(lmdb_pack, {"seed": 0}, epoch=epoch, batch_size=5, num_workers=workers, collate_fn=keys_of)
        for epoch, workers in ((3, 2), (None, 1))
    )
    check_save_load([first, then], 2, save=resume_state(epoch=3), load=into_dataset, keys=list)


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (lambda p: (p / "data.mdb").write_bytes(b"this is not an lmdb file" * 1000), ShardkitError, "photos.lmdb"),
        (lambda p: os.truncate(p / "data.mdb", 8192), ShardkitError, "photos.lmdb"),
    ],
)
def test_bad_lmdb_files_give_clear_errors(lmdb_pack: Path, damage, error, message: str) -> None:  # type: ignore[no-untyped-def]
    (lmdb_pack / "index.json").unlink()
    damage(lmdb_pack)
    with pytest.raises(error, match=message):
        LMDBDataset(str(lmdb_pack))


def test_not_an_lmdb_and_missing_keys(tmp_path: Path, lmdb_pack: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetNotFoundError):
        LMDBDataset(str(tmp_path / "empty"))
    import lmdb

    lmdb_format.close_reader(str(lmdb_pack))
    env = lmdb.open(str(lmdb_pack))
    with env.begin(write=True) as txn:
        key = json.loads(txn.get(b"__index__"))["keys"][5]
        for ext in ("cls", "jpg", "json"):
            txn.delete(f"{key}.{ext}".encode())
    env.close()
    with pytest.raises(CorruptShardError, match=f"sample {key} is missing"):
        LMDBDataset(str(lmdb_pack))[5]


def test_bad_samples_and_wrong_folders_are_named(photos: Path, tmp_path: Path) -> None:
    whole = (photos / "circle" / "img_0003.jpg").read_bytes()
    dqt = whole.find(b"\xff\xdb") + 4  # a quantization table numbered 5 (0-3 exist): whole to the eye, not decodable
    (photos / "circle" / "img_0003.jpg").write_bytes(whole[:dqt] + b"\x05" + whole[dqt + 1 :])
    out = tmp_path / "photos.lmdb"
    shardkit.pack(str(photos), str(out), format="lmdb", shuffle=False, progress=False)
    ds = LMDBDataset(str(out), decode="tensor")
    keys = shardkit.index.load(str(out)).extra["keys"]
    said = rf"photos.lmdb: sample {keys[3]} \(packed from circle/img_0003\.jpg\): field .jpg.: OSError"
    with pytest.raises(CorruptShardError, match=said):
        ds[3]
    with pytest.raises(CorruptShardError, match=said) as err:
        list(StreamingDataset(str(out), decode="tensor"))
    assert "at byte" not in str(err.value)  # an LMDB sample has a key, not an offset
    shardkit.pack(str(photos), str(tmp_path / "shards"), progress=False)
    with pytest.raises(DatasetNotFoundError, match="not an LMDB dataset .*read them with StreamingDataset"):
        LMDBDataset(str(tmp_path / "shards"))


def test_remote_lmdb_is_copied_to_the_cache_first(s3: dict, lmdb_pack: Path, tmp_path: Path) -> None:
    import fsspec.core

    fs, root = fsspec.core.url_to_fs(s3["url"] + "/photos.lmdb", **s3["storage_options"])
    fs.put(str(lmdb_pack / "data.mdb"), f"{root}/data.mdb")
    fs.put(str(lmdb_pack / "index.json"), f"{root}/index.json")
    url = s3["url"] + "/photos.lmdb"
    ds = LMDBDataset(url, storage_options=s3["storage_options"], cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 30 and ds.path.startswith(str(tmp_path / "cache"))
    stream = StreamingDataset(url, storage_options=s3["storage_options"], cache_dir=str(tmp_path / "cache"))
    assert sorted(s["__key__"] for s in stream) == sorted(ds[i]["__key__"] for i in range(30))
    size = (lmdb_pack / "data.mdb").stat().st_size
    for make, more in ((LMDBDataset, {}), (StreamingDataset, {"prefetch_bytes": 1})):  # too large: refused
        with pytest.raises(ShardkitError, match=rf"photos\.lmdb/data\.mdb: {size} bytes do not fit in cache_limit"):
            make(
                url,
                storage_options=s3["storage_options"],
                cache_dir=str(tmp_path / "small"),
                cache_limit=size - 1,
                **more,
            )
    assert not (tmp_path / "small").exists() or not any((tmp_path / "small").rglob("data.mdb"))


def test_one_lmdb_under_several_spellings_and_many_copies(lmdb_pack: Path, tmp_path: Path) -> None:
    import shutil

    os.symlink(lmdb_pack, tmp_path / "link")
    first = [LMDBDataset(p)[0]["__key__"] for p in (str(lmdb_pack), str(lmdb_pack) + "/", str(tmp_path / "link"))]
    assert len(set(first)) == 1  # one environment, found by its file
    kept = LMDBDataset(str(tmp_path / "link"))
    for i in range(40):  # copies read then deleted: their inode numbers come back for the next copies
        copy = tmp_path / f"copy{i}"
        shutil.copytree(lmdb_pack, copy)
        assert LMDBDataset(str(copy))[0]["__key__"] == first[0]
        shutil.rmtree(copy)
    old = tmp_path / "old-copy"
    shutil.copytree(lmdb_pack, old)
    reading = LMDBDataset(str(old))
    shutil.rmtree(old)  # as a remote LMDB's older local copy is, when the bucket's changes
    assert LMDBDataset(str(lmdb_pack))[1]["__key__"] == reading[1]["__key__"] == kept[1]["__key__"]  # reads on


def test_an_inode_number_of_a_deleted_copy_coming_back(
    lmdb_pack: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LMDB refuses a file whose inode number an open environment holds: that of a copy
    deleted since is closed then, and the open tried again."""
    import shutil

    import lmdb

    old = tmp_path / "old"
    shutil.copytree(lmdb_pack, old)
    LMDBDataset(str(old))[0]
    shutil.rmtree(old)
    real_open, refused = lmdb.open, []

    def reused(path: str, **kwargs: object):  # type: ignore[no-untyped-def]
        if not refused:
            refused.append(path)
            raise lmdb.Error(f"The environment '{path}' is already open in this process.")
        return real_open(path, **kwargs)

    monkeypatch.setattr(lmdb, "open", reused)
    new = tmp_path / "new"
    shutil.copytree(lmdb_pack, new)
    assert len(LMDBDataset(str(new))) == 30 and refused
    assert not any(e.path == str(old) for e in lmdb_envs._ENVS)  # the deleted copy's was closed


def test_keys_beyond_ascii(photos: Path, tmp_path: Path) -> None:
    import tarfile

    (tmp_path / "foreign").mkdir()
    jpg = next(photos.rglob("*.jpg"))
    with tarfile.open(tmp_path / "foreign" / "part-0.tar", "w") as tar:
        for key in ("café", "naïve/日本"):
            tar.add(jpg, f"{key}.jpg")
    from shardkit.index.resolve import shard_urls

    shardkit.index.save(shardkit.build_index(shard_urls(str(tmp_path / "foreign"))), str(tmp_path / "foreign"))
    shardkit.pack(str(tmp_path / "foreign"), str(tmp_path / "db"), format="lmdb", workers=1, progress=False)
    assert sorted(s["__key__"] for s in LMDBDataset(str(tmp_path / "db"))) == ["café", "naïve/日本"]
    assert sorted(s["__key__"] for s in StreamingDataset(str(tmp_path / "db"))) == ["café", "naïve/日本"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(keys=d["keys"][:10]), "needs a key for each of its 30 samples, it lists 10 keys"),
        (lambda d: d.update(sizes=d["sizes"][:10]), "lists 10 sizes for 30 keys"),
        (lambda d: d.update(shards=[], samples=0), "lists 0 shards, not the one data.mdb"),
        (lambda d: d["keys"].__setitem__(3, 0), "LMDB key 3 is 0, not a sample key"),
        (lambda d: d["keys"].__setitem__(4, d["keys"][4] + "\0"), "LMDB key 4 is '000004\\x00', not a sample key"),
        (lambda d: d["sizes"].__setitem__(5, None), "LMDB size 5 is None, not a size in bytes"),
    ],
)
def test_an_lmdb_index_that_contradicts_itself_is_refused(lmdb_pack: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads((lmdb_pack / "index.json").read_text())
    edit(doc)
    (lmdb_pack / "index.json").write_text(json.dumps(doc))
    for read in (StreamingDataset, shardkit.verify):
        with pytest.raises(CorruptShardError, match=re.escape(message)):
            read(str(lmdb_pack))


def test_a_record_whose_length_changed_is_named(lmdb_pack: Path) -> None:
    import lmdb

    keys = shardkit.index.load(str(lmdb_pack)).extra["keys"]
    lmdb_format.close_reader(str(lmdb_pack))
    env = lmdb.open(str(lmdb_pack))
    with env.begin(write=True) as txn:
        txn.put(f"{keys[2]}.cls".encode(), b"12345")
    env.close()
    with pytest.raises(CorruptShardError, match=f"photos.lmdb: sample {keys[2]}: more than .* bytes, the index says"):
        LMDBDataset(str(lmdb_pack))[2]
    with pytest.raises(CorruptShardError, match=f"sample {keys[2]}: more than .* bytes, the index says"):
        list(StreamingDataset(str(lmdb_pack)))
    stream = StreamingDataset(str(lmdb_pack), on_error="skip")
    assert len(list(stream)) == 30 and stream.stats()["skipped"] == 1  # replaced, as a tar sample would be
    idx = shardkit.pack(str(lmdb_pack), str(lmdb_pack.parent / "tar"), workers=1, progress=False)  # converted: skipped
    assert idx.samples == 29 and "the index says" in idx.skipped[-1].reason


def test_an_lmdb_grown_past_the_readers_map_is_named(lmdb_pack: Path) -> None:
    """A pack finished in place while a training process holds the environment: one line
    naming the file, from datasets made before as after (not lmdb's bare MapResizedError)."""
    import lmdb

    lmdb_format.close_reader(str(lmdb_pack))
    size = (lmdb_pack / "data.mdb").stat().st_size
    env = lmdb.open(str(lmdb_pack), map_size=size + (1 << 20))  # the map readers open with: just above the data
    with env.begin(write=True) as txn:
        txn.put(b"zz", b"")  # (a commit records it)
    env.close()
    ds, stream = LMDBDataset(str(lmdb_pack)), StreamingDataset(str(lmdb_pack))
    assert ds[0]["__key__"] == next(iter(stream))["__key__"]
    grow = (
        f"import lmdb; env = lmdb.open({str(lmdb_pack)!r}, map_size={size + (64 << 20)})\n"
        "with env.begin(write=True) as txn: txn.put(b'zz', bytes(16 << 20))"
    )  # past py-lmdb's 10 MB least map
    subprocess.run([sys.executable, "-c", grow], check=True)
    message = "photos.lmdb: data.mdb grew past its map since this process opened it"
    for read in (lambda: ds[1], lambda: next(iter(stream)), lambda: LMDBDataset(str(lmdb_pack))):
        with pytest.raises(ShardkitError, match=message):
            read()


def test_readahead_and_an_unfinished_pack(
    lmdb_pack: Path, tmp_path: Path, photos: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = LMDBDataset(str(lmdb_pack), readahead=True)
    assert lmdb_format.open_reader(ds.path).flags()["readahead"]  # the main process's own reads too
    with monkeypatch.context() as m:  # killed before the last commit
        m.setattr(
            lmdb_format.Writer,
            "write",
            lambda self, samples, meta, delete=(): (
                None if lmdb_format.INDEX_KEY in meta else _original_write(self, samples, meta, delete)
            ),
        )
        shardkit.pack(str(photos), str(tmp_path / "db"), format="lmdb", workers=1, progress=False)
    (tmp_path / "db" / "index.json").unlink()
    with pytest.raises(shardkit.UnfinishedPackError, match="a pack into this LMDB has not finished"):
        LMDBDataset(str(tmp_path / "db"))
    lmdb_format.Writer(str(tmp_path / "empty")).close()  # what a pack killed before its first commit leaves
    for read in (
        lambda: LMDBDataset(str(tmp_path / "empty")),
        lambda: shardkit.StreamingDataset(str(tmp_path / "empty")),
    ):
        with pytest.raises(shardkit.UnfinishedPackError, match="a pack into this LMDB has not finished"):
            read()


_original_write = lmdb_format.Writer.write


def test_a_dataset_built_after_another_process_repacked_reads_the_new_data(photos: Path, tmp_path: Path) -> None:
    """This process's environment of the old data.mdb is not taken for the file now there:
    replaced by `--overwrite`, or grown by the pack that finished an unfinished one."""
    out = tmp_path / "db"
    shardkit.pack(str(photos), str(out), format="lmdb", workers=1, progress=False)
    old = LMDBDataset(str(out))
    more = make_folder(tmp_path / "more", per_class=12)
    cmd = [sys.executable, "-m", "shardkit.cli", "pack", str(more), str(out), "--format", "lmdb", "-q", "--overwrite"]
    subprocess.run(cmd, check=True)
    assert len(LMDBDataset(str(out))) == 36 and len(list(StreamingDataset(str(out)))) == 36
    with pytest.raises(CorruptShardError, match="the index says"):  # the old one: its index is not this file's
        old[0]

    grown = tmp_path / "grown"  # opened unfinished, then finished by another process in the same file
    with pytest.MonkeyPatch.context() as m:
        m.setattr(
            lmdb_format.Writer,
            "write",
            lambda self, samples, meta, delete=(): (
                None if lmdb_format.INDEX_KEY in meta else _original_write(self, samples, meta, delete)
            ),
        )
        shardkit.pack(str(more), str(grown), format="lmdb", workers=1, progress=False)
    with pytest.raises(shardkit.UnfinishedPackError):
        LMDBDataset(str(grown))
    subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "pack", str(more), str(grown), "--format", "lmdb", "-q"], check=True
    )
    assert len(LMDBDataset(str(grown))) == 36 and len(list(StreamingDataset(str(grown)))) == 36


def test_a_key_too_long_for_lmdb_is_skipped_by_the_conversion(tmp_path: Path) -> None:
    import io
    import tarfile

    (tmp_path / "wds").mkdir()
    long_key = "d/" * 300 + "x"
    with tarfile.open(tmp_path / "wds" / "part-0.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for key in ("a", long_key, "b"):
            for ext, data in (("cls", b"1"), ("txt", key.encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    subprocess.run(
        [sys.executable, "-m", "shardkit.cli", "index", str(tmp_path / "wds")], check=True, capture_output=True
    )
    idx = shardkit.pack(str(tmp_path / "wds"), str(tmp_path / "out"), format="lmdb", workers=1, progress=False)
    assert idx.samples == 2 and len(idx.skipped) == 1
    assert "605 bytes as an LMDB key, over LMDB's 511" in idx.skipped[0].reason
    with pytest.raises(shardkit.SourceError, match="over LMDB's 511"):
        shardkit.pack(
            str(tmp_path / "wds"), str(tmp_path / "fail"), format="lmdb", on_error="raise", workers=1, progress=False
        )


def test_lmdb_jobs_stay_moderate_without_a_size_limit(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One transaction per job, held in memory: max_size=None must not make it one job."""
    import importlib

    pack_module = importlib.import_module("shardkit.packing.sinks.lmdb")
    commits: list[int] = []

    def counting(self, samples, meta, delete=()):  # type: ignore[no-untyped-def]
        commits.append(len(samples))
        return _original_write(self, samples, meta, delete)

    monkeypatch.setattr(pack_module, "JOB_BYTES", 20_000)
    monkeypatch.setattr(lmdb_format.Writer, "write", counting)
    idx = shardkit.pack(str(photos), str(tmp_path / "db"), format="lmdb", max_size=None, workers=1, progress=False)
    sizes = idx.extra["sizes"]
    assert len([n for n in commits if n]) > 1 and sum(commits) == 30
    assert max(commits) <= 20_000 // min(sizes) + 1


def test_a_remote_lmdb_converts_to_tar(s3: dict, lmdb_pack: Path, tmp_path: Path) -> None:
    import fsspec.core

    url, opts = s3["url"] + "/convert.lmdb", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(lmdb_pack / "data.mdb"), f"{root}/data.mdb")
    fs.put(str(lmdb_pack / "index.json"), f"{root}/index.json")
    idx = shardkit.pack(url, str(tmp_path / "tar"), storage_options=opts, workers=1, progress=False)
    assert idx.samples == 30 and not idx.skipped
    local = {s["__key__"]: s["jpg"] for s in StreamingDataset(str(lmdb_pack))}
    assert {s["__key__"]: s["jpg"] for s in StreamingDataset(str(tmp_path / "tar"))} == local


def test_what_is_wrong_with_a_damaged_lmdb_is_said(lmdb_pack: Path) -> None:
    import lmdb

    keys = shardkit.index.load(str(lmdb_pack)).extra["keys"]
    lmdb_format.close_reader(str(lmdb_pack))
    env = lmdb.open(str(lmdb_pack))
    with env.begin(write=True) as txn:
        txn.delete(f"{keys[5]}.jpg".encode())
    env.close()
    with pytest.raises(
        CorruptShardError,
        match=rf"sample {keys[5]}: \d+ bytes in cls, json, the index says \d+ "
        r"\(a member missing or shrunk\)",
    ):
        LMDBDataset(str(lmdb_pack))[5]
    lmdb_format.close_reader(str(lmdb_pack))
    os.truncate(lmdb_pack / "data.mdb", 0)
    with pytest.raises(CorruptShardError, match=r"photos\.lmdb: data\.mdb is truncated \(0 bytes"):
        LMDBDataset(str(lmdb_pack))
    (lmdb_pack / "data.mdb").unlink()
    with pytest.raises(DatasetNotFoundError, match="its index.json is an LMDB dataset's, data.mdb is gone"):
        LMDBDataset(str(lmdb_pack))


def test_a_file_touched_in_place_keeps_its_readers(lmdb_pack: Path) -> None:
    """A dataset built while another reads the same data.mdb, written in place since (here
    only its time), shares the environment: it is never closed under the running pass."""
    stream = iter(StreamingDataset(str(lmdb_pack)))
    first = next(stream)["__key__"]
    os.utime(lmdb_pack / "data.mdb")
    assert len(LMDBDataset(str(lmdb_pack))) == 30
    assert [first] + [s["__key__"] for s in stream] == [s["__key__"] for s in StreamingDataset(str(lmdb_pack))]


def test_verify_and_remote_copies_under_a_users_environment(s3: dict, lmdb_pack: Path, tmp_path: Path) -> None:
    """verify's child imports what this process imports, not a same-named module in the
    working folder; a remote copy counts its bytes itself (with tqdm turned off too)."""
    import fsspec.core

    work = tmp_path / "work"
    work.mkdir()
    (work / "lmdb.py").write_text("raise ImportError('the wrong lmdb')\n")
    (work / "shardkit.py").write_text("raise ImportError('the wrong shardkit')\n")
    url, opts = s3["url"] + "/user.lmdb", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(lmdb_pack / "data.mdb"), f"{root}/data.mdb")
    fs.put(str(lmdb_pack / "index.json"), f"{root}/index.json")
    endpoint = opts["client_kwargs"]["endpoint_url"]
    env = {**os.environ, "TQDM_DISABLE": "1", "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    shardkit_cli = [sys.executable, "-c", "import sys; sys.path.remove(''); from shardkit.cli import main; main()"]
    for args in (
        ["verify", str(lmdb_pack)],
        ["verify", url, "-o", f"endpoint_url={endpoint}"],
        ["pack", url, str(tmp_path / "tar"), "-q", "-o", f"endpoint_url={endpoint}"],
    ):
        done = subprocess.run(shardkit_cli + args, cwd=work, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (args, done.stdout, done.stderr)
    assert len(list(StreamingDataset(str(tmp_path / "tar")))) == 30


def test_a_file_cut_short_in_place_is_caught_at_the_next_build(lmdb_pack: Path) -> None:
    """Truncated after this process opened it: named, not a SIGBUS (in a child: a SIGBUS
    would take the test run with it)."""
    code = (
        "import os, sys; from shardkit import LMDBDataset; p = sys.argv[1]; LMDBDataset(p)[0]\n"
        "os.truncate(os.path.join(p, 'data.mdb'), 3 * 4096)\n"
        "try:\n    LMDBDataset(p)\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(lmdb_pack)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("CorruptShardError"), done
    assert "data.mdb is truncated (12288 bytes, its pages need" in done.stdout


def test_verify_takes_only_absolute_import_paths(lmdb_pack: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [Path("/nowhere"), "relative/dir", "", *sys.path])
    assert shardkit.verify(str(lmdb_pack)) == []


def _foreign_tar(folder: Path, members: list[tuple[str, bytes]], name: str = "part-0.tar") -> None:
    """A tar of `members` in that order, as another tool writes it, indexed."""
    import io
    import tarfile

    folder.mkdir(exist_ok=True)
    with tarfile.open(folder / name, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _index(folder: Path) -> None:
    from shardkit.index.resolve import shard_urls

    shardkit.index.save(shardkit.build_index(shard_urls(str(folder))), str(folder))


def test_a_key_that_comes_twice_is_refused_not_overwritten(tmp_path: Path) -> None:
    """Two writers each starting at key 000000: tar keeps both samples, an LMDB cannot, and
    says so instead of keeping the last one."""
    for s in range(2):
        _foreign_tar(
            tmp_path / "wds", [("000000.cls", str(s).encode()), ("000000.txt", b"shard %d" % s)], f"part-{s}.tar"
        )
    _index(tmp_path / "wds")
    with pytest.raises(ShardkitError, match=r"db: sample key '000000' comes twice in the source.*pack to tar"):
        shardkit.pack(str(tmp_path / "wds"), str(tmp_path / "db"), format="lmdb", workers=1, progress=False)
    shardkit.pack(str(tmp_path / "wds"), str(tmp_path / "t"), workers=1, progress=False)
    assert [s["txt"] for s in StreamingDataset(str(tmp_path / "t"))] == ["shard 0", "shard 1"]


def test_a_key_that_prefixes_a_folder_reads_only_its_own_records(tmp_path: Path) -> None:
    """`v1` and `v1.2/0001`: the records `v1.cls` and `v1.2/0001.cls` share the prefix `v1.`."""
    _foreign_tar(
        tmp_path / "wds",
        [
            ("v1.cls", b"1"),
            ("v1.txt", b"one"),
            ("v1.2/0001.cls", b"2"),
            ("v1.2/0001.txt", b"two"),
            ("v1.d/0001.cls", b"3"),
        ],
    )
    _index(tmp_path / "wds")
    shardkit.pack(str(tmp_path / "wds"), str(tmp_path / "db"), format="lmdb", workers=1, progress=False)
    want = [("v1", {"cls": 1, "txt": "one"}), ("v1.2/0001", {"cls": 2, "txt": "two"}), ("v1.d/0001", {"cls": 3})]
    for ds in (LMDBDataset(str(tmp_path / "db")), StreamingDataset(str(tmp_path / "db"))):
        assert [(s["__key__"], {k: v for k, v in s.items() if not k.startswith("_")}) for s in ds] == want
    assert shardkit.verify(str(tmp_path / "db")) == []
    env = lmdb_format.open_reader(str(tmp_path / "db"))
    with env.begin(buffers=True) as txn, txn.cursor() as cur:  # what reads and touches walk (not a whole folder)
        assert list(lmdb_records.members(cur, b"v1.")) == [b"v1.cls", b"v1.txt"]


def test_a_member_without_extension_keeps_its_name(tmp_path: Path) -> None:
    import tarfile

    _foreign_tar(tmp_path / "wds", [("LICENSE", b"text"), ("000000.cls", b"0")])
    _index(tmp_path / "wds")
    shardkit.pack(str(tmp_path / "wds"), str(tmp_path / "t"), workers=1, progress=False)
    shardkit.pack(str(tmp_path / "wds"), str(tmp_path / "db"), format="lmdb", workers=1, progress=False)
    shardkit.pack(str(tmp_path / "db"), str(tmp_path / "back"), workers=1, progress=False)
    for out in ("t", "back"):
        with tarfile.open(tmp_path / out / "shard-000000.tar") as tar:
            assert tar.getnames() == ["LICENSE", "000000.cls"]
    assert (tmp_path / "t" / "shard-000000.tar").read_bytes() == (tmp_path / "back" / "shard-000000.tar").read_bytes()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not an lmdb", "data.mdb is truncated (11 bytes"),
        (b"", "data.mdb is truncated (0 bytes"),
        ("cut", "data.mdb is truncated (8192 bytes, its pages need"),
    ],
)
def test_a_bad_data_mdb_in_dest_is_refused_in_one_line(
    photos: Path, lmdb_pack: Path, tmp_path: Path, content, message: str
) -> None:  # type: ignore[no-untyped-def]
    dest = tmp_path / "dest"
    dest.mkdir()
    data = (lmdb_pack / "data.mdb").read_bytes()[:8192] if content == "cut" else content
    (dest / "data.mdb").write_bytes(data)
    result = subprocess.run(
        [sys.executable, "-m", "shardkit", "pack", str(photos), str(dest), "--format", "lmdb", "-q"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and message in result.stderr and "pack into another folder" in result.stderr
    assert (dest / "data.mdb").read_bytes() == data  # left as it was
