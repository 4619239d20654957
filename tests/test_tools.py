"""`shardkit bench` and `shardkit preview`, through click's CliRunner (tiny batches, few passes)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from conftest import CLASSES
from shardkit.cli import main
from shardkit.tools.preview import LABEL_H, TILE, TILE_BACKGROUND, grid_size, render_preview, tile_box

FAST = ("--batch-size", "8", "--batches", "3", "--passes", "2", "--warmup", "1")

USER_TRANSFORMS = """
import time

import torch

from shardkit.decode import image_transform

sized = image_transform(16, crop=None)


def slow(sample):
    time.sleep(0.015)  # a heavy augmentation: workers run it in parallel
    return sample["jpg"][:, :16, :16], sample["cls"]


def normalised(sample):
    image = sample["jpg"].float() / 255
    return (image - 0.5) / 0.25, sample["cls"]


def not_an_image(sample):
    return sample["cls"]


def crashes(sample):
    raise ValueError("boom")


def uneven(sample):  # sizes that differ from sample to sample do not stack into a batch
    return sample["jpg"][:, : 8 + int(sample["__key__"]) % 3, :8]


def half(sample):  # bfloat16: numpy has no such type
    return (sample["jpg"].float() / 255).to(torch.bfloat16)
"""


@pytest.fixture
def run():  # type: ignore[no-untyped-def]
    runner = CliRunner()

    def invoke(*args: object):  # type: ignore[no-untyped-def]
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture
def user_module(tmp_path: Path) -> Path:
    path = tmp_path / "user_transforms.py"
    path.write_text(USER_TRANSFORMS)
    return path


# ------------------------------------------------------------------ bench


def test_bench_table_verdicts_and_recommendation(run, packed: Path) -> None:  # type: ignore[no-untyped-def]
    result = run("bench", packed, "--workers", "0,2", *FAST, "--step-ms", "0.001")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("num_workers"))
    for column in ("prefetch", "images/s", "MB/s", "first batch", "peak RSS"):
        assert column in lines[header]
    rows = [line.split() for line in lines[header + 1 : header + 3]]
    assert [r[0] for r in rows] == ["0", "2"] and all(r.count("±") == 2 for r in rows)
    assert "num_workers=0: " in result.stdout and "num_workers=2: " in result.stdout
    verdicts = [line for line in lines if "ms per batch" in line]
    assert len(verdicts) == 2 and all(line.endswith("> 0.001 ms step: data-bound") for line in verdicts)
    assert lines[-1].startswith("recommendation: num_workers=")
    assert lines[-1].endswith(("more adds under 5%", "more is no faster", "the fastest tested, more may help"))


def test_bench_json_and_plot(run, packed: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    result = run(
        "bench", packed, "--workers", "0", "--prefetch", "1,4", *FAST, "--step-ms", "1e6", "--json", "--plot", png
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["varied"] == "prefetch" and doc["batch_size"] == 8 and doc["passes"] == 2
    assert [(s["num_workers"], s["prefetch"]) for s in doc["settings"]] == [(0, 1), (0, 4)]
    for s in doc["settings"]:
        assert len(s["images_per_s"]) == len(s["mb_per_s"]) == 2 and min(s["images_per_s"]) > 0
        assert s["mean_mb_per_s"] > 0 and s["first_batch_s"] > 0 and s["bytes_per_sample"] > 0
        assert s["data_bound"] is False and s["stats"]["samples"] >= 8
        if s["peak_rss_bytes"] is not None:  # Linux
            assert s["peak_rss_bytes"] >= s["peak_main_rss_bytes"] > 0
    assert doc["recommendation"]["prefetch"] in (1, 4) and doc["recommendation"]["text"].startswith("prefetch=")
    with Image.open(png) as img:
        assert img.format == "PNG" and img.width > 0 and img.height > 0


def test_slow_transform_makes_workers_pay_off(run, packed: Path, user_module: Path) -> None:  # type: ignore[no-untyped-def]
    result = run(
        "bench",
        packed,
        "--workers",
        "0,2",
        "--batch-size",
        "4",
        "--batches",
        "8",
        "--passes",
        "3",
        "--warmup",
        "2",
        "--transform",
        f"{user_module}:slow",
        "--json",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    # each setting's fastest pass: a busy machine only ever slows a pass down
    rate = {s["num_workers"]: max(s["images_per_s"]) for s in doc["settings"]}
    assert rate[2] > 1.5 * rate[0], rate  # sleeping in two workers at once: about twice as fast
    assert doc["recommendation"]["num_workers"] == 2
    assert doc["transform"].endswith("user_transforms.py:slow")
    with_workers = next(s for s in doc["settings"] if s["num_workers"] == 2)
    if with_workers["peak_rss_bytes"] is not None:  # Linux: the workers' memory is counted too
        assert with_workers["peak_rss_bytes"] > with_workers["peak_main_rss_bytes"]


def test_plot_without_matplotlib_is_refused_before_any_work(
    run,
    packed: Path,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    result = run("bench", packed, "--workers", "0", *FAST, "--plot", tmp_path / "p.png")
    assert result.exit_code == 2 and "--plot" in result.output and "pip install matplotlib" in result.output
    assert "images/s" not in result.output and not (tmp_path / "p.png").exists()


def test_bench_varies_prefetch_on_a_bucket(run, s3: dict, packed: Path) -> None:  # type: ignore[no-untyped-def]
    import fsspec.core

    url, opts = s3["url"] + "/bench", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    endpoint = opts["client_kwargs"]["endpoint_url"]
    result = run(
        "bench",
        url,
        "--prefetch",
        "1,4",
        *FAST,
        "--json",
        "-o",
        f"endpoint_url={endpoint}",
        "-o",
        "key=testing",
        "-o",
        "secret=testing",
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["varied"] == "prefetch" and [s["prefetch"] for s in doc["settings"]] == [1, 4]
    assert all(s["stats"]["fetched_bytes"] > 0 and s["mean_images_per_s"] > 0 for s in doc["settings"])


@pytest.mark.parametrize("command", ["bench", "preview"])
def test_a_failing_transform_is_one_line_naming_it(
    run,
    packed: Path,
    tmp_path: Path,
    user_module: Path,  # type: ignore[no-untyped-def]
    command: str,
) -> None:
    more = ("--workers", "2", *FAST) if command == "bench" else ("--out", tmp_path / "p.png")
    result = run(command, packed, "--transform", f"{user_module}:crashes", *more)
    assert result.exit_code == 1 and len(result.output.splitlines()) == 1, result.output
    assert f"--transform {user_module}:crashes failed on sample " in result.output
    assert result.output.rstrip().endswith(": ValueError: boom")


def test_bench_and_preview_odd_results_and_options(run, packed: Path, tmp_path: Path, user_module: Path) -> None:  # type: ignore[no-untyped-def]
    result = run("bench", packed, "--workers", "1", *FAST, "--transform", f"{user_module}:uneven")
    assert result.exit_code == 1 and result.output.count("\n") == 1, result.output
    assert re.search(
        r"^Error: batch_size=8: cannot stack sample \d of a batch: the sample is torch.uint8 of shape", result.output
    )
    result = run("bench", packed, "--step-ms", "nan")
    assert result.exit_code == 2 and "a number of milliseconds, not nan" in result.output
    result = run(
        "preview",
        packed,
        "--n",
        "2",
        "--out",
        tmp_path / "h.png",
        "--decode",
        "tensor",
        "--transform",
        f"{user_module}:half",
    )
    assert result.exit_code == 0, result.output
    if importlib.util.find_spec("matplotlib") is not None:
        assert run("bench", packed, "--workers", "0", *FAST, "--plot", tmp_path / "b.jpg").exit_code == 0
        with Image.open(tmp_path / "b.jpg") as img:
            assert img.format == "JPEG"


def test_bench_in_process_runs_on_one_torch_thread_as_a_worker_would(packed: Path) -> None:
    """num_workers=0 measured on all of torch's threads against workers on one each made the
    main process look several times slower on a busy machine: one thread, then restored."""
    import torch

    from shardkit.bench.loader import bench_setting
    from shardkit.bench.transforms import ResizeTransform

    seen: list[int] = []
    resize = ResizeTransform(32)

    def transform(sample):  # type: ignore[no-untyped-def]
        seen.append(torch.get_num_threads())
        return resize(sample)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        bench_setting(
            str(packed),
            num_workers=0,
            prefetch=2,
            batch_size=4,
            decode="tensor",
            transform=transform,
            batches=2,
            passes=1,
            warmup=1,
        )
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


HOLD_MEMORY = """
import mmap, os, sys
shared = mmap.mmap(-1, 64 << 20)                          # 64 MB of shared memory, touched
shared.write(b"x" * (64 << 20))
private = bytearray(b"y" * (64 << 20))                    # and 64 MB of the process's own
mapped, tell = os.pipe()
if os.fork() == 0:                                        # a child that maps the same shared pages
    shared[::4096]
    os.write(tell, b"x")
    sys.stdin.read()                                      # both hold it all until stdin closes
    os._exit(0)
os.read(mapped, 1)
print("ready", flush=True)
sys.stdin.read()
os.wait()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_peak_memory_counts_rss_per_process_and_pages_in_use_once() -> None:
    """RSS sums count the shared pages in both processes (and the child's copy-on-write view
    of the parent's heap); memory in use counts each page of the tree once, and nothing
    outside it (the 256 MB this process holds meanwhile, or a busy machine's)."""
    import subprocess
    import time

    from shardkit.bench.memory import PeakRss

    class Counted(PeakRss):
        samples = 0

        def sample(self) -> None:
            super().sample()
            self.samples += 1

    with subprocess.Popen([sys.executable, "-c", HOLD_MEMORY], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        peak = Counted(interval=0.02, pid=proc.pid)
        peak.start()
        outside = b"z" * (256 << 20)
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"  # the tree holds its memory
        deadline, taken = time.monotonic() + 30, peak.samples
        while peak.samples < taken + 2 and time.monotonic() < deadline:  # a whole sample of it, however slow
            time.sleep(0.02)
    peak.stop()  # leaving `with` closed the tree's stdin: it exited
    del outside
    assert proc.returncode == 0
    mb = 1 << 20
    assert peak.peak_total is not None and peak.peak_in_use is not None
    assert peak.peak_total >= 2 * 64 * mb + 64 * mb  # shared twice, the heap at least once
    assert 120 * mb <= peak.peak_in_use < peak.peak_total


def test_bench_usage_errors(run, packed: Path, user_module: Path) -> None:  # type: ignore[no-untyped-def]
    result = run("bench", packed, "--transform", "no_such_module_xyz:fn")
    assert result.exit_code == 2
    assert "cannot import module 'no_such_module_xyz'" in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1
    result = run("bench", packed, "--transform", f"{user_module}:missing")
    assert result.exit_code == 2 and "has no function 'missing'" in result.output
    result = run("bench", packed, "--transform", "no_colon")
    assert result.exit_code == 2 and "expected module:function" in result.output
    result = run("bench", packed, "--workers", "0,1", "--prefetch", "1,4")
    assert result.exit_code == 2 and "one setting at a time" in result.output
    result = run("bench", packed, "--workers", "zero")
    assert result.exit_code == 2 and "comma-separated integers" in result.output
    result = run("bench", packed.parent / "nothing-here")
    assert result.exit_code == 1 and "nothing-here" in result.output


def test_bench_on_samples_without_an_image_says_so_in_one_line(run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import tarfile

    (tmp_path / "wds").mkdir()
    (tmp_path / "a.txt").write_text("text")
    with tarfile.open(tmp_path / "wds" / "part-0.tar", "w") as tar:
        for key in ("a", "b"):
            tar.add(tmp_path / "a.txt", f"{key}.txt")
    result = run(
        "bench",
        tmp_path / "wds",
        "--workers",
        "0",
        "--batches",
        "1",
        "--passes",
        "1",
        "--warmup",
        "1",
        "--batch-size",
        "2",
    )
    assert result.exit_code == 1 and "has no image field (give --transform)" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


# ------------------------------------------------------------------ preview


def _check_tiles(png: Path, n: int, tile: int = TILE) -> None:
    with Image.open(png) as img:
        assert img.size == grid_size(n, tile)
        pixels = np.asarray(img.convert("RGB")).astype(np.float64)
    for i in range(n):
        left, top, right, bottom = tile_box(i, n, tile)
        square = pixels[top:bottom, left:right]
        assert square.std() > 5, f"tile {i} is blank"
        assert (square == TILE_BACKGROUND).all(axis=-1).mean() < 0.5, f"tile {i} shows no image"
        label = pixels[bottom : bottom + LABEL_H, left:right]
        assert (label.min(axis=-1) > 150).sum() > 20, f"tile {i} has no label"


def test_preview_writes_a_labelled_grid(run, packed: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "batch.png"
    result = run("preview", packed, "--n", "6", "--out", png, "--seed", "3")
    assert result.exit_code == 0, result.output
    assert "6 samples, 3x2 grid" in result.output
    _check_tiles(png, 6)
    doc = render_preview(str(packed), n=6, out=str(tmp_path / "again.png"), seed=3)
    assert all(name in CLASSES for name, _ in doc["labels"])
    assert (tmp_path / "again.png").read_bytes() == png.read_bytes()  # the seed decides
    other = render_preview(str(packed), n=6, out=str(tmp_path / "other.png"), seed=4)
    assert other["labels"] != doc["labels"]


def test_preview_and_bench_outputs(run, packed: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    result = run("preview", packed, "--n", "4", "--out", tmp_path / "grid.jpg")
    assert result.exit_code == 0
    with Image.open(tmp_path / "grid.jpg") as img:
        assert img.format == "JPEG"  # the format its name says
    for command in (("preview", packed, "--out"), ("bench", packed, "--plot")):
        result = run(*command, tmp_path / "missing" / "x.png")  # refused before any work
        assert result.exit_code == 2 and "no such folder to write it in" in result.output


def test_preview_after_a_transform(run, packed: Path, tmp_path: Path, user_module: Path) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "normalised.png"
    result = run(
        "preview",
        packed,
        "--n",
        "5",
        "--out",
        png,
        "--decode",
        "tensor",
        "--tile",
        "64",
        "--transform",
        f"{user_module}:normalised",
    )
    assert result.exit_code == 0, result.output
    _check_tiles(png, 5, tile=64)
    result = run(
        "preview",
        packed,
        "--n",
        "2",
        "--out",
        tmp_path / "x.png",
        "--decode",
        "tensor",
        "--transform",
        f"{user_module}:not_an_image",
    )
    assert result.exit_code == 1 and "not an image" in result.output
    result = run("preview", packed, "--transform", "no_such_module_xyz:fn")
    assert result.exit_code == 2 and "no_such_module_xyz" in result.output


def test_preview_and_bench_skip_bad_samples_when_asked(run, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shardkit
    from readers import break_image

    dataset = tmp_path / "shards"
    shardkit.pack(str(photos), str(dataset), max_count=4, workers=1, progress=False)
    shard, key = break_image(dataset, 2, 1)
    png = tmp_path / "all.png"
    user = tmp_path / "user_transforms.py"
    user.write_text(USER_TRANSFORMS)
    # the reader's decoder, or preview's own drawing of raw bytes, or a transform decoding them finds it
    for how in ((), ("--decode", "raw"), ("--decode", "raw", "--transform", f"{user}:sized")):
        result = run("preview", dataset, "--n", "30", "--out", png, *how)
        assert result.exit_code == 1 and result.output.count("\n") == 1, result.output  # one line, no "skipped" line
        assert re.fullmatch(
            rf"Error: \S+/{shard}: sample {key}( at byte \d+)? \(packed from \w+/img_\d+\.jpg\): "
            r".*UnidentifiedImageError: .*; --on-error skip leaves bad samples out; `shardkit verify "
            r"--decode` lists every bad sample, `shardkit pack --decode-check` keeps them out of a pack\n",
            result.output,
        ), result.output
        result = run("preview", dataset, "--n", "30", "--out", png, "--on-error", "skip", *how)
        assert result.exit_code == 0, result.output
        assert result.output.endswith("29 samples, 6x5 grid, 782x802 px, 1 bad sample skipped\n"), result.output
    whole_epoch = ("--workers", "0", "--batch-size", "10", "--batches", "3", "--passes", "1", "--warmup", "1")
    result = run("bench", dataset, *whole_epoch)
    assert (
        result.exit_code == 1
        and shard in result.output
        and "; --on-error skip leaves bad samples out;" in result.output
    )
    result = run("bench", dataset, *whole_epoch[2:], "--workers", "2")  # raised in a worker: one line all the same
    assert result.exit_code == 1 and shard in result.output and len(result.output.splitlines()) == 1, result.output
    assert "(packed from " in result.output and "--on-error skip leaves bad samples out" in result.output
    result = run(
        "bench",
        dataset,
        *whole_epoch,
        "--decode",
        "raw",
        "--transform",
        f"{user}:sized",
        "--on-error",
        "skip",
        "--json",
    )  # image_transform's bad image is bad data, skipped, not the transform failing
    assert result.exit_code == 0 and json.loads(result.stdout)["settings"][0]["stats"]["skipped"] >= 1, result.output
    result = run("bench", dataset, *whole_epoch, "--on-error", "skip", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["settings"][0]["stats"]["skipped"] >= 1
    assert "skipped bad samples: up to" in run("bench", dataset, *whole_epoch, "--on-error", "skip").output
