"""Shards made by other tools: webdataset's ShardWriter, plain `tar`, pickle-like members."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import torch
from conftest import CLASSES
from PIL import Image

from shardkit.reading.dataset import StreamingDataset

from readers import WARNINGS, check_ranks, run

pytestmark = WARNINGS


def write_wds(folder: Path, photos: Path) -> list[tuple[str, bytes, int]]:
    import webdataset as wds

    folder.mkdir()
    files = sorted(photos.glob("*/*.jpg"))[:23]
    samples = [(f"s{i:04d}", f.read_bytes(), CLASSES.index(f.parent.name)) for i, f in enumerate(files)]
    with wds.ShardWriter(str(folder / "wds-%06d.tar"), maxcount=5, verbose=0) as sink:
        for key, jpg, cls in samples:
            sink.write({"__key__": key, "jpg": jpg, "cls": cls})
    return samples


def test_webdataset_shards(photos: Path, tmp_path: Path) -> None:
    samples = write_wds(tmp_path / "wds", photos)
    shards = sorted((tmp_path / "wds").glob("*.tar"))
    assert [p.name for p in shards] == [f"wds-{i:06d}.tar" for i in range(5)]
    sources: list[Any] = [
        str(tmp_path / "wds" / "wds-{000000..000004}.tar"),
        [str(p) for p in shards],
        str(tmp_path / "wds"),
    ]
    for source in sources:
        ds = StreamingDataset(source)
        assert len(ds) == 23
        got = list(ds)
        assert [(s["__key__"], s["jpg"], s["cls"]) for s in got] == samples
        assert Path(got[-1]["__url__"]).name == "wds-000004.tar"
    # index offsets learned from the scan work under ranks and workers too
    per_rank = [
        run(StreamingDataset(sources[0], shuffle=True, rank=r, world_size=2, decode="rgb8"), 2) for r in range(2)
    ]
    check_ranks(per_rank, [k for k, _, _ in samples], "repeat", 12)


def test_plain_tar_with_dotted_names(photos: Path, tmp_path: Path) -> None:
    from webdataset.tariterators import base_plus_ext

    top = tmp_path / "src" / "v1.0"
    top.mkdir(parents=True)
    jpgs = sorted(photos.glob("*/*.jpg"))[:3]
    names = []
    for stem, jpg in zip(("a", "b", "c"), jpgs):
        (top / f"{stem}.left.view.jpg").write_bytes(jpg.read_bytes())
        (top / f"{stem}.cls").write_text(str(CLASSES.index(jpg.parent.name)))
        names += [f"v1.0/{stem}.cls", f"v1.0/{stem}.left.view.jpg"]
    shard = tmp_path / "plain.tar"
    subprocess.run(["tar", "cf", str(shard), "-C", str(tmp_path / "src"), *names], check=True)
    got = list(StreamingDataset([str(shard)]))
    assert [s["__key__"] for s in got] == ["v1.0/a", "v1.0/b", "v1.0/c"]
    # webdataset splits the same names the same way
    assert [base_plus_ext(n) for n in names[:2]] == [("v1.0/a", "cls"), ("v1.0/a", "left.view.jpg")]
    assert [base_plus_ext(n)[0] for n in names[::2]] == [s["__key__"] for s in got]
    for s, jpg in zip(got, jpgs):
        assert set(s) == {"__key__", "__url__", "cls", "left.view.jpg"}
        assert s["left.view.jpg"] == jpg.read_bytes()
        assert s["cls"] == CLASSES.index(jpg.parent.name)
    decoded = list(StreamingDataset([str(shard)], decode="pil"))
    assert all(isinstance(s["left.view.jpg"], Image.Image) for s in decoded)


class _Trap:
    """Unpickling this makes a folder: proves a member was (or wasn't) unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


def test_pickle_like_members_stay_bytes(tmp_path: Path) -> None:
    import webdataset as wds

    trap = tmp_path / "unpickled"
    (tmp_path / "out").mkdir()
    payloads = {"pyd": pickle.dumps(_Trap(str(trap))), "pickle": pickle.dumps({"a": [1, 2]})}
    with wds.ShardWriter(str(tmp_path / "out" / "x-%06d.tar"), maxcount=10, verbose=0) as sink:
        sink.write(
            {"__key__": "k0", "pyd": payloads["pyd"], "pickle": payloads["pickle"], "pth": torch.arange(4), "cls": 1}
        )
    for mode in ("raw", "pil", "tensor"):
        (s,) = list(StreamingDataset(str(tmp_path / "out"), decode=mode))
        assert s["pyd"] == payloads["pyd"] and s["pickle"] == payloads["pickle"]
        assert isinstance(s["pth"], bytes)
        assert torch.equal(torch.load(io.BytesIO(s["pth"])), torch.arange(4))
        assert s["cls"] == 1
    assert not trap.exists()
