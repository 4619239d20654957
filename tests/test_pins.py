"""Every store pins its shards: a shard replaced under its name by another shard's bytes, of
the very same size, is named at its first read on local disk, moto's and SeaweedFS's S3, both
GCS emulators and WebHDFS, and handled by on_error; a plain copy of a local dataset (new
modification times) still reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import fsspec
import pytest
from conftest import draw
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptShardError, StreamingDataset, index
from shardkit.storage import fingerprint

from readers import WARNINGS

pytestmark = WARNINGS

MARKS = {"local": "fingerprint", "s3": "etag", "seaweedfs": "etag", "gcs": "generation", "fakegcs": "generation",
         "webhdfs": "mtime_ns"}


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 classes x 20 BMPs of one size: packed 20 a shard, two shards of the same size."""
    root = tmp_path_factory.mktemp("twins")
    for label, name in enumerate(("ones", "twos")):
        for i in range(20):
            draw(root / name / f"img_{i:04d}.bmp", label, seed=label * 1000 + i, fmt="BMP")
    return root


def keys(ds: StreamingDataset, workers: int = 0) -> list[str]:
    return [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=workers)]


@pytest.mark.parametrize("store", list(MARKS))
def test_a_shard_replaced_by_a_twin_is_named_at_its_first_read(store: str, twins: Path, tmp_path: Path,
                                                                 request: pytest.FixtureRequest) -> None:
    if store == "local":
        url, opts = str(tmp_path / "ds"), None
    else:
        remote = request.getfixturevalue(store)
        url, opts = remote["url"] + "/ds", remote["storage_options"]
    idx = shardkit.pack(str(twins), url, max_count=20, workers=1, progress=False, storage_options=opts)
    first, second = idx.shards
    assert first.bytes == second.bytes and all(s.version is not None and list(s.version) == [MARKS[store]]
                                               for s in idx.shards)
    fs, root = fsspec.core.url_to_fs(url, **(opts or {}))
    fs.pipe_file(f"{root}/{second.name}", fs.cat_file(f"{root}/{first.name}"))  # the other shard's bytes
    with pytest.raises(CorruptShardError, match=rf"^{url}/{second.name}: changed since its index was made"):
        keys(StreamingDataset(url, storage_options=opts))
    skipping = StreamingDataset(url, storage_options=opts, on_error="skip", shuffle=True)
    got = keys(skipping, workers=2)
    # skipped samples are stood in for by others (every rank gets len(ds)): only the first shard's keys
    assert len(got) == 40 and set(got) == {f"{i:06d}" for i in range(20)}
    assert skipping.stats()["skipped"] == 20


def test_a_plain_copy_of_a_local_dataset_still_reads(twins: Path, tmp_path: Path) -> None:
    """New modification times and inodes (cp -r, rsync without -t) are no reason to refuse
    a shard: its pin is its contents. Two packs of the same input write the same index."""
    shardkit.pack(str(twins), str(tmp_path / "ds"), max_count=20, workers=1, progress=False)
    shardkit.pack(str(twins), str(tmp_path / "again"), max_count=20, workers=1, progress=False)
    assert (tmp_path / "ds" / "index.json").read_bytes() == (tmp_path / "again" / "index.json").read_bytes()
    shutil.copytree(tmp_path / "ds", tmp_path / "copy", copy_function=shutil.copyfile)  # mtimes not kept
    assert len(set(keys(StreamingDataset(str(tmp_path / "copy")), workers=2))) == 40


def test_a_local_dataset_copied_up_keeps_its_fingerprints(twins: Path, tmp_path: Path, s3: dict) -> None:
    """Packed on local disk, copied to a bucket as it is: its shards' fingerprints are checked
    there too (two ranged reads as a shard is opened), until `shardkit index --versions`
    records the store's own versions."""
    local = tmp_path / "ds"
    idx = shardkit.pack(str(twins), str(local), max_count=20, workers=1, progress=False)
    url, opts = s3["url"] + "/up", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(local), root, recursive=True)
    assert len(keys(StreamingDataset(url, storage_options=opts))) == 40
    first, second = idx.shards
    fs.pipe_file(f"{root}/{second.name}", (local / first.name).read_bytes())
    with pytest.raises(CorruptShardError, match=rf"^{url}/{second.name}: changed since its index was made \(its "
                                                 r"size or its first or last 64 KiB"):
        keys(StreamingDataset(url, storage_options=opts))
    index.save(index.pinned(index.load(url, opts), url, opts), url, opts)
    assert [list(s.version or ()) for s in index.load(url, opts).shards] == [["etag"], ["etag"]]


def test_a_fingerprint_reads_both_ends_and_the_size(tmp_path: Path) -> None:
    """Bytes changed at either end, or one byte more, change it; a change in the middle of a
    big shard does not (verify=True's whole-shard sha256 is for that)."""
    data = bytes(range(256)) * 2048  # 512 KiB
    path = tmp_path / "f"

    def of(b: bytes) -> str:
        path.write_bytes(b)
        return fingerprint.of_path(str(path))

    base = of(data)
    for changed in (b"x" + data[1:], data[:-1] + b"x", data + b"\0", data[:-1]):
        assert of(changed) != base
    assert of(data[:200_000] + b"x" + data[200_001:]) == base
    assert of(b"") != of(b"\0") and json.dumps({"fingerprint": base})  # a short file: its one range
    assert fingerprint.ranges(10) == [(0, 10)] and fingerprint.ranges(0) == []
