"""Every example, run as a user runs it (a subprocess, from another working directory) on tiny
data, checked on what it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardkit
from conftest import CLASSES, draw

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    proc = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, f"{args} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def example(name: str, *args: object) -> list[str]:
    return [sys.executable, str(EXAMPLES / name), *map(str, args)]


@pytest.mark.timeout(120)
def test_train_local(packed: Path, tmp_path: Path) -> None:
    out = run(example("train_local.py", packed, "--epochs", 1, "--workers", 2, "--batch-size", 16), tmp_path)
    assert "8 batches of up to 16 per epoch, 3 classes, 2 workers" in out
    assert re.search(r"epoch 0: 120 samples in [\d.]+ s = \d+ samples/s, loss [\d.]+", out), out


@pytest.fixture(scope="module")
def other_formats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder of PNG, WebP and GIF images (each its own field: no jpg), 3 classes x 6."""
    root = tmp_path_factory.mktemp("formats")
    for label, name in enumerate(CLASSES):
        for i in range(6):
            fmt = ("PNG", "WEBP", "GIF")[i % 3]
            draw(root / "photos" / name / f"{i}.{fmt.lower()}", label, seed=i, fmt=fmt)
    return root / "photos"


@pytest.mark.timeout(120)
def test_train_local_takes_any_image_format(other_formats: Path, tmp_path: Path) -> None:
    shardkit.pack(str(other_formats), str(tmp_path / "shards"), workers=1, progress=False)
    out = run(
        example("train_local.py", tmp_path / "shards", "--epochs", 1, "--workers", 1, "--batch-size", 8), tmp_path
    )
    assert re.search(r"epoch 0: 18 samples in [\d.]+ s = \d+ samples/s", out), out


@pytest.mark.timeout(120)
def test_stream_demo_takes_another_tools_label_field(other_formats: Path, tmp_path: Path) -> None:
    """Shards of another tool (no index.json) whose class is in `cls2`: --label cls2."""
    import tarfile

    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "part-000.tar", "w") as tar:
        for i, path in enumerate(sorted(other_formats.rglob("*.*"))):
            (tmp_path / f"{i}.cls2").write_text(str(CLASSES.index(path.parent.name)))
            tar.add(path, f"{i:04d}{path.suffix}")
            tar.add(tmp_path / f"{i}.cls2", f"{i:04d}.cls2")
    out = run(
        example("stream_demo.py", tmp_path / "wds", "--batch-size", 8, "--workers", 1, "--label", "cls2"), tmp_path
    )
    assert "classes: {0: 6, 1: 6, 2: 6}" in out


WITHOUT_SKIMAGE = (
    "import runpy, sys; sys.modules['skimage'] = None; sys.argv = sys.argv[1:]; "  # as if not installed
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skimage", [True, False])
def test_pack_and_stream(tmp_path: Path, skimage: bool) -> None:
    """The tour does what the README says: pack, stream, resume; with scikit-image (the
    `examples` extra) or, drawing its photos with PIL, without."""
    args = example(
        "pack_and_stream.py",
        "--dir",
        tmp_path / "tour",
        "--images",
        30,
        "--classes",
        3,
        "--small",
        "--size",
        64,
        "--crop",
        56,
        "--batch-size",
        8,
    )
    out = run(args if skimage else [sys.executable, "-c", WITHOUT_SKIMAGE, *args[1:]], tmp_path)
    assert ("no scikit-image: drawing the photos with PIL" in out) is not skimage
    assert (
        "4. resumed epoch 0 after 8 samples (ds.resume_state): 22 samples, 22 distinct, just those the first "
        "run had not reached" in out
    ), out
    assert "1. 30 photos in 3 classes" in out
    assert re.search(r"2\. packed into .*: 30 samples, \d+ shards?", out), out
    assert "images (8, 3, 56, 56) torch.uint8, labels (8,)" in out
    assert re.search(r"streamed 30 samples in [\d.]+ s: \d+ samples/s with 2 workers", out), out
    histogram = {int(m[1]): int(m[2]) for m in re.finditer(r"^ +(\d+) +class_\d+ +(\d+)", out, re.M)}
    assert histogram == {0: 10, 1: 10, 2: 10}, out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_ddp_train_gives_every_rank_the_same_batches(launcher: str, packed: Path, tmp_path: Path) -> None:
    args = [EXAMPLES / "ddp_train.py", packed, "--epochs", 1, "--workers", 2, "--batch-size", 8]
    if launcher == "torchrun":
        if not TORCHRUN.exists():
            pytest.skip("no torchrun beside this Python")
        cmd = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", *map(str, args)]
    else:
        cmd = [sys.executable, *map(str, args), "--spawn", "2"]
    out = run(cmd, tmp_path)
    assert "2 ranks x 2 workers: 8 batches per rank per epoch, 3 classes" in out
    # each rank: 60 samples in whole batches of 8 split between 2 workers: 7 full batches and one of 4
    assert re.search(
        r"epoch 0: batches per rank \[8, 8\], samples per rank \[60, 60\]; 120 samples in [\d.]+ s = "
        r"\d+ samples/s",
        out,
    ), out


@pytest.mark.timeout(120)
def test_stream_demo(packed: Path, tmp_path: Path) -> None:
    out = run(example("stream_demo.py", packed, "--batch-size", 16, "--workers", 2), tmp_path)
    assert "first batch: images (16, 3, 128, 128) torch.uint8, labels (16,)" in out
    assert re.search(r"120 samples in 8 batches, [\d.]+ s, \d+ images/s", out), out
    assert "classes: {0: 40, 1: 40, 2: 40}" in out
