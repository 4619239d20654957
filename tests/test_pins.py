"""Every store pins its shards: a shard replaced under its name by another shard's bytes, of
the very same size, is named at its first read on local disk, moto's and SeaweedFS's S3, both
GCS emulators and WebHDFS, and handled by on_error; a plain copy of a local dataset (new
modification times) still reads."""

from __future__ import annotations

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

MARKS = {
    "local": "fingerprint",
    "s3": "etag",
    "seaweedfs": "etag",
    "gcs": "generation",
    "fakegcs": "generation",
    "webhdfs": "mtime_ns",
}


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
def test_a_shard_replaced_by_a_twin_is_named_at_its_first_read(
    store: str, twins: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if store == "local":
        url, opts = str(tmp_path / "ds"), None
    else:
        remote = request.getfixturevalue(store)
        url, opts = remote["url"] + "/ds", remote["storage_options"]
    idx = shardkit.pack(str(twins), url, max_count=20, workers=1, progress=False, storage_options=opts)
    first, second = idx.shards
    assert first.bytes == second.bytes and all(
        s.version is not None and list(s.version) == [MARKS[store]] for s in idx.shards
    )
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
    there too (one ranged read as a shard is opened), until `shardkit index --versions`
    records the store's own versions."""
    local = tmp_path / "ds"
    idx = shardkit.pack(str(twins), str(local), max_count=20, workers=1, progress=False)
    url, opts = s3["url"] + "/up", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(local), root, recursive=True)
    assert len(keys(StreamingDataset(url, storage_options=opts))) == 40
    first, second = idx.shards
    fs.pipe_file(f"{root}/{second.name}", (local / first.name).read_bytes())
    with pytest.raises(
        CorruptShardError,
        match=rf"^{url}/{second.name}: changed since its index was made \(its "
        r"first 512 bytes are not the index's\)",
    ):
        keys(StreamingDataset(url, storage_options=opts))
    index.save(index.pinned(index.load(url, opts), url, opts), url, opts)
    assert [list(s.version or ()) for s in index.load(url, opts).shards] == [["etag"], ["etag"]]


def test_a_fingerprint_tells_shards_apart_not_bad_bytes_inside_them(tmp_path: Path) -> None:
    """Another head, or one byte more, is another shard; a change past the first block is bad
    data inside a shard (named sample by sample; verify=True's sha256 sees it); a file cut
    short with its head unchanged is no mismatch (the reader says where it ends)."""
    data = bytes(range(256)) * 2048  # 512 KiB
    path = tmp_path / "f"
    path.write_bytes(data)
    base = fingerprint.of_path(str(path))

    def mismatch(b: bytes) -> str | None:
        return fingerprint.mismatch(base, len(b), lambda start, stop: b[start:stop])

    assert mismatch(data) is None and mismatch(data[:-1] + b"x") is None
    assert mismatch(data[:300_000]) is None and mismatch(data[:100]) is None  # cut short
    assert mismatch(b"x" + data[1:]) == "its first 512 bytes are not the index's"
    assert (
        mismatch(b"x" + data[1:300_000]) == "300000 bytes, the index has 524288, and its first 512 bytes are not "
        "the index's"
    )
    assert mismatch(data + b"\0") == "524289 bytes, the index has 524288"
    assert "not one this shardkit writes" in str(fingerprint.mismatch("abc", 3, lambda a, b: b"abc"))
    assert fingerprint.fingerprint(0, lambda a, b: b"") != fingerprint.fingerprint(1, lambda a, b: b"\0")


def test_an_s3_compatible_endpoint_works_from_endpoint_url_alone(
    seaweedfs: dict, twins: Path, seaweedfs_server: str
) -> None:
    """A store on another endpoint than AWS's, named by a host name: packs and reads with the
    endpoint alone; shardkit's decision for such endpoints is path-style addressing and
    checksums only where S3's API requires them (as MinIO, Ceph and R2 want). (botocore
    addresses `localhost` path-style itself: the pack here does not tell the decision apart.)"""
    from shardkit.storage.clients import s3_compatible

    opts = {
        **seaweedfs["storage_options"],
        "client_kwargs": {"endpoint_url": seaweedfs_server.replace("127.0.0.1", "localhost")},
    }
    url = seaweedfs["url"] + "/named"
    shardkit.pack(str(twins), url, max_count=20, workers=1, progress=False, storage_options=opts)
    assert len(set(keys(StreamingDataset(url, storage_options=opts)))) == 40
    decided = s3_compatible(opts)
    assert decided == {
        "s3": {"addressing_style": "path"},
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
    }
    assert s3_compatible({"endpoint_url": "http://h", "config_kwargs": {"s3": {"addressing_style": "virtual"}}})[
        "s3"
    ] == {"addressing_style": "virtual"}
    assert s3_compatible({}) == {} and s3_compatible({"endpoint_url": "https://s3.eu-west-1.amazonaws.com"}) == {}
