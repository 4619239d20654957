"""The pack's inputs by registry (packing/inputs/): each kind claims what it reads, the
first claim wins, and a kind added to INPUTS is consulted like the others."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_folder

import shardkit
from shardkit.packing import inputs
from shardkit.packing.inputs import INPUTS, Kind, Scanned, identify
from shardkit.packing.plan import make_plan


def test_each_kind_claims_its_input(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", per_class=2)
    (tmp_path / "list.csv").write_text("path\nsrc/a/0.jpg\n")
    for fmt in ("tar", "lmdb"):
        shardkit.pack(str(src), str(tmp_path / fmt), format=fmt, workers=1, progress=False)
    assert identify(str(src)) == (INPUTS["folder"], "folder")
    assert identify(str(tmp_path / "list.csv")) == (INPUTS["manifest"], "manifest")
    assert identify(str(tmp_path / "tar")) == (INPUTS["dataset"], "tar")
    assert identify(str(tmp_path / "lmdb")) == (INPUTS["dataset"], "lmdb")


def test_a_converted_dataset_keeps_its_order_and_index(tmp_path: Path) -> None:
    src = make_folder(tmp_path / "src", per_class=3)
    idx = shardkit.pack(str(src), str(tmp_path / "tar"), workers=1, progress=False)
    scanned = INPUTS["dataset"].scan(str(tmp_path / "tar"), None, "classes", ())
    assert scanned.converted is not None and scanned.input_kind == "tar"
    assert scanned.classes == idx.classes and len(scanned.listing) == idx.samples
    with pytest.raises(shardkit.SourceError, match="layout and fields describe an image folder"):
        make_plan(str(tmp_path / "tar"), str(tmp_path / "out"), layout="flat")


def test_a_kind_registered_first_is_asked_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_folder(tmp_path / "src", per_class=2)
    classes = make_plan(str(src), str(tmp_path / "out")).classes
    scans: list[str] = []

    def scan(src: str, storage_options: object, layout: str, fields: tuple[str, ...]) -> Scanned:
        scans.append(src)
        found = INPUTS["folder"].scan(src, None, layout, fields)
        return Scanned(found.src, tuple(c.upper() for c in found.classes), found.listing)

    mine = Kind(lambda s, o: "mine" if s.endswith("src") else None, scan, shaped=True)
    monkeypatch.setattr(inputs, "INPUTS", {"mine": mine, **INPUTS})
    assert identify(str(src)) == (mine, "mine")
    plan = make_plan(str(src), str(tmp_path / "out"))
    assert scans == [str(src)] and plan.classes == tuple(c.upper() for c in classes) != classes
