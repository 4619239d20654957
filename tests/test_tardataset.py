"""TarDataset: map-style access to tar shards by the index's offsets, locally and in buckets."""

from __future__ import annotations

import functools
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import shardkit
from shardkit import StreamingDataset, TarDataset
from shardkit.errors import CorruptShardError, ShardkitError

from conftest import CLASSES, make_folder
from servers import serving
from test_storage_errors import _Ranges


def keys(samples: Any) -> list[str]:
    return [s["__key__"] for s in samples]


def fields(samples: Any) -> list[dict]:
    """Samples without their `__url__` (where they were read from)."""
    return [{k: v for k, v in s.items() if k != "__url__"} for s in samples]


def test_every_sample_by_index_as_the_stream_reads_it(packed: Path) -> None:
    ds = TarDataset(str(packed))
    stream = list(StreamingDataset(str(packed)))
    assert len(ds) == len(stream) == 120
    assert ds.classes == CLASSES
    for i in (0, 1, 6, 7, 60, 119):
        assert {k: v for k, v in ds[i].items()} == stream[i]
    assert ds[-1] == stream[-1] and ds[-120] == stream[0]
    for bad in (120, -121):
        with pytest.raises(IndexError, match=f"index {bad} out of range for 120 samples"):
            ds[bad]
    with pytest.raises(TypeError, match="index"):
        ds["3"]  # type: ignore[index]


def test_decode_and_transform(packed: Path) -> None:
    tensor = TarDataset(str(packed), decode="tensor")[5]
    assert tensor["jpg"].dtype == torch.uint8 and tensor["jpg"].shape[0] == 3
    assert isinstance(tensor["cls"], int) and isinstance(tensor["json"], dict)
    ds = TarDataset(str(packed), transform=shardkit.decode.image_transform(32, 24))
    image, label = ds[5]
    assert image.shape == (3, 24, 24) and label == tensor["cls"]
    with pytest.raises(ValueError, match="decode must be one of"):
        TarDataset(str(packed), decode="jpeg")


def test_shuffled_dataloader_and_distributed_sampler_see_each_sample_once(packed: Path) -> None:
    ds = TarDataset(str(packed), decode="rgb8", transform=lambda s: s["__key__"])
    everything = sorted(ds[i] for i in range(len(ds)))
    loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
    got = [k for batch in loader for k in batch]
    assert sorted(got) == everything and got != everything
    parts = []
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, shuffle=True, seed=1)
        parts.append([k for batch in DataLoader(ds, batch_size=5, sampler=sampler, num_workers=1) for k in batch])
    assert all(len(p) == 40 for p in parts) and sorted(sum(parts, [])) == everything


def _key(sample: dict) -> str:
    return sample["__key__"]


def test_pickles_for_spawned_workers(packed: Path) -> None:
    ds = TarDataset(str(packed), transform=_key)
    ds[0]  # a reader opened in this process is not pickled
    again = pickle.loads(pickle.dumps(ds))
    assert [again[i] for i in range(len(again))] == [ds[i] for i in range(len(ds))]
    loader = DataLoader(ds, batch_size=None, shuffle=True, num_workers=1, multiprocessing_context="spawn")
    assert sorted(loader) == sorted(ds[i] for i in range(len(ds)))


def test_shards_of_other_tools(tmp_path: Path) -> None:
    import webdataset as wds

    (tmp_path / "wds").mkdir()
    with wds.ShardWriter(str(tmp_path / "wds" / "part-%06d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(10):
            sink.write({"__key__": f"k{i:02d}", "txt": f"caption {i}", "cls": i % 3})
    ds = TarDataset(str(tmp_path / "wds" / "part-{000000..000002}.tar"))
    assert len(ds) == 10
    assert ds[7]["txt"] == "caption 7" and ds[7]["cls"] == 1 and ds[7]["__key__"] == "k07"


def test_compressed_shards_are_refused_by_name(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "photos", per_class=2)
    subprocess.run(["tar", "czf", str(tmp_path / "a.tar.gz"), "-C", str(src), "."], check=True)
    with pytest.raises(
        ShardkitError,
        match=r"a.tar.gz: gzip-compressed: a stream, no sample can be read "
        r"without inflating all before it.*shardkit pack",
    ):
        TarDataset(str(tmp_path / "a.tar.gz"))


def test_a_truncated_shard_names_shard_and_sample(packed: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    shard = copy / "shard-000003.tar"
    shard.write_bytes(shard.read_bytes()[:3000])
    ds = TarDataset(str(copy))
    first = sum(s.samples for s in ds.index.shards[:3])
    ds[first - 1]  # shard 2: fine
    with pytest.raises(CorruptShardError, match=r"shard-000003.tar \(sample at byte 0\): cut off"):
        ds[first]


def test_an_undecodable_image_names_the_sample(tmp_path: Path) -> None:
    import io

    import numpy as np
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(out, "PNG")
    data = bytearray(out.getvalue())
    data[data.index(b"IDAT") + 200] ^= 0xFF  # ends intact: packed, but does not decode
    (tmp_path / "photos" / "a").mkdir(parents=True)
    (tmp_path / "photos" / "a" / "damaged.png").write_bytes(bytes(data))
    shardkit.pack(str(tmp_path / "photos"), str(tmp_path / "ds"), workers=1, progress=False)
    ds = TarDataset(str(tmp_path / "ds"), decode="rgb8")
    with pytest.raises(CorruptShardError, match=r"shard-000000.tar: sample 000000: field 'png'"):
        ds[0]
    assert TarDataset(str(tmp_path / "ds"))[0]["png"] == bytes(data)  # raw: the bytes as they are


def test_in_a_bucket_with_the_cache(s3: dict, packed: Path, tmp_path: Path) -> None:
    url, opts = s3["url"] + "/ds", s3["storage_options"]
    shardkit.pack(str(packed), url, workers=1, progress=False, storage_options=opts)  # a conversion: same samples
    ds = TarDataset(url, storage_options=opts, cache_dir=str(tmp_path / "cache"))
    local = TarDataset(str(packed))
    order = [5, 119, 0, 64, 5]
    assert fields(ds[i] for i in order) == fields(local[i] for i in order)
    assert len(os.listdir(tmp_path / "cache")) > 0
    batches = DataLoader(
        TarDataset(url, storage_options=opts, transform=_key), batch_size=8, shuffle=True, num_workers=2
    )  # each worker fetches a batch's samples on threads
    assert sorted(k for batch in batches for k in batch) == sorted(keys(local[i] for i in range(len(local))))


@pytest.mark.parametrize("store", ["gcs", "http"])
def test_over_gcs_and_http(store: str, request: pytest.FixtureRequest, packed: Path, tmp_path: Path) -> None:
    local = TarDataset(str(packed))
    if store == "gcs":
        remote = request.getfixturevalue("gcs")
        url, opts = remote["url"] + "/ds", remote["storage_options"]
        shardkit.pack(str(packed), url, workers=1, progress=False, storage_options=opts)
        ds = TarDataset(url, storage_options=opts)
        assert fields(ds[i] for i in (3, 77)) == fields(local[i] for i in (3, 77))
        return
    (tmp_path / "www").mkdir()
    os.symlink(packed, tmp_path / "www" / "ds")
    with serving(functools.partial(_Ranges, directory=str(tmp_path / "www"))) as base:
        ds = TarDataset(base + "/ds")
        assert len(ds) == 120 and fields(ds[i] for i in (3, 77)) == fields(local[i] for i in (3, 77))


def test_gz_members_are_inflated_and_capped(tmp_path: Path) -> None:
    import webdataset as wds

    (tmp_path / "wds").mkdir()
    with wds.TarWriter(str(tmp_path / "wds" / "a.tar")) as sink:
        sink.write({"__key__": "doc", "json.gz": b'{"boxes": [1, 2]}', "txt.gz": b"x" * 5000})  # gzipped by the writer
    assert TarDataset(str(tmp_path / "wds" / "a.tar"))[0]["json.gz"] == {"boxes": [1, 2]}
    capped = TarDataset(str(tmp_path / "wds" / "a.tar"), max_member_size=1000)
    with pytest.raises(CorruptShardError, match=r"a.tar: sample doc: field 'txt.gz': inflates to more than 1000 bytes"):
        capped[0]
