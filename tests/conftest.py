"""Shared fixtures: small generated image folders and packed datasets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read by gcsfs at import

import numpy as np
import pytest
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))  # make_images

# real S3, GCS, WebHDFS and Azure servers on loopback (tests/servers/)
pytest_plugins = ["servers.fixtures", "servers.store_fixtures", "servers.azurite"]

CLASSES = ("circle", "square", "triangle")


def draw(path: Path, label: int, seed: int, size: tuple[int, int] = (48, 40), fmt: str = "JPEG") -> None:
    """A small PIL drawing whose shape depends on the class: real, decodable images."""
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", size, tuple(int(c) for c in rng.integers(0, 255, 3)))
    d = ImageDraw.Draw(img)
    box = [int(v) for v in (rng.integers(0, 10), rng.integers(0, 10), size[0] - 5, size[1] - 5)]
    fill = tuple(int(c) for c in rng.integers(0, 255, 3))
    if label == 0:
        d.ellipse(box, fill=fill)
    elif label == 1:
        d.rectangle(box, fill=fill)
    else:
        d.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, fmt, **({"quality": 85} if fmt == "JPEG" else {}))


def make_folder(root: Path, per_class: int = 10, classes: tuple[str, ...] = CLASSES) -> Path:
    for label, name in enumerate(classes):
        for i in range(per_class):
            draw(root / name / f"img_{i:04d}.jpg", label, seed=label * 100_000 + i)
    return root


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], world: int) -> None:
    """`fn(rank, *args)` for each rank in `world` real processes, joined. Each is forked from
    a forkserver that imported torch once, not spawned: a spawned rank pays ~2.5 CPU s for
    torch alone (19 ranks in test_elastic_batches), and no rank inherits this process's state."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])  # for a forkserver not yet started
    mp.start_processes(fn, args=args, nprocs=world, join=True, start_method="forkserver")


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL `proc`'s process group (started with start_new_session=True) and wait until
    every process of it is gone, not only `proc`: a pool worker still dying holds what it
    inherited (a pack's lock), and a rerun at once would find the pack still running."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process group {proc.pid} still alive 30 s after SIGKILL")


@pytest.fixture(autouse=True)
def _impatient_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dataset's reads get ~21 s of retries on average before one fails: the tests of
    failures take 5 attempts instead (test_remote's outage test restores the real count)."""
    from shardkit.storage import patience

    monkeypatch.setattr(patience, "OUTAGE_RETRIES", patience.RETRIES)


@pytest.fixture(autouse=True)
def _no_latency_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no first-byte latencies seen, whatever ran before it in its process
    (under pytest-xdist, other tests each run): a history of fast GETs left by another test
    would have a slow answer hedged, and a count of requests come out one more."""
    from shardkit.storage import latencies

    monkeypatch.setattr(latencies, "_SEEN", {})


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    """An ImageFolder tree: 3 classes x 10 JPEGs."""
    return make_folder(tmp_path / "photos")


@pytest.fixture(scope="session")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A packed dataset shared by read-only tests: 3 classes x 40 images in shards of 7."""
    import shardkit

    root = tmp_path_factory.mktemp("packed")
    src = make_folder(root / "photos", per_class=40)
    shardkit.pack(str(src), str(root / "shards"), max_count=7, workers=1, progress=False)
    return root / "shards"


def webdataset_samples(urls: list[str]) -> list[dict]:
    """Read shards with the webdataset library (which leaves its files to the garbage
    collector: collect them here, where their ResourceWarning is expected)."""
    import gc
    import warnings

    import webdataset as wds

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        samples = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
        gc.collect()
    return samples


def shard_offsets(folder: Path) -> dict[str, list[int]]:
    """{shard name: its sample offsets} of a packed dataset (from its sidecar)."""
    import shardkit

    idx = shardkit.index.with_offsets(shardkit.index.load(str(folder)))
    return {s.name: list(s.offsets) for s in idx.shards}  # type: ignore[arg-type]


def as_version_1(folder: Path, dest: Path) -> Path:
    """A copy of the tar dataset `folder` whose index.json is of version 1 (each shard's
    offsets inside its entry, no sidecar), as shardkit 0.1 wrote them."""
    import json
    import shutil

    shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("offsets-*.npy", "index.json"))
    doc = json.loads((folder / "index.json").read_text())
    tables = shard_offsets(folder)
    doc.update(version=1, shards=[{**s, "offsets": tables[s["name"]]} for s in doc["shards"]])
    del doc["offsets"]
    (dest / "index.json").write_text(json.dumps(doc))
    return dest


@pytest.fixture(scope="session")
def packed_v1(packed: Path) -> Path:
    """`packed` with an index.json of version 1 (beside it, as its source images are)."""
    return as_version_1(packed, packed.parent / "shards-v1")


@pytest.fixture(params=["v2", "v1"])
def any_index(request: pytest.FixtureRequest, packed: Path) -> Path:
    """`packed` under each index version a reader takes: a test of a guarantee runs on both."""
    return packed if request.param == "v2" else request.getfixturevalue("packed_v1")


# Test files whose tests share a costly module fixture (test_ray's cluster: ~15 s of CPU to
# start): under pytest-xdist's --dist loadgroup (scripts/test.sh) each goes whole to one worker.
# An xdist_group mark would say it, but with pytest 9.2 xdist 3.8 ignores the marks
# (pytest-xdist issue 1386): the scheduler groups by file name instead.
TOGETHER = frozenset({"tests/test_ray.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Scheduler(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return file if file in TOGETHER else super()._split_scope(nodeid)

    return Scheduler(config, log)


# The slowest tests (minutes of a 4-process run of the suite, busy 2-core machine), started
# first so that none of them starts last and leaves the other processes idle at the end:
# node id prefixes, slowest first. A test not named here keeps its place after them.
SLOW_FIRST = (
    "tests/test_elastic_batches.py",
    "tests/test_lint.py::test_mypy",
    "tests/test_remote.py::test_a_stalled_connection_fails_in_bounded_time",
    "tests/test_examples.py",
    "tests/test_ddp.py",
    "tests/test_multinode.py",
    "tests/test_scripts.py",
    "tests/test_dataset.py::test_spawned_workers",
    "tests/test_dataset.py::test_workers_freeze",
    "tests/test_packaging.py::test_the_wheel",
    "tests/test_hostile.py::test_no_secret_of_s3_credentials_in_any_error",
    "tests/test_sidecars.py::test_the_clip_snippet",
    "tests/test_tools.py::test_preview_and_bench_skip_bad_samples",
    "tests/test_lmdb.py::test_verify_and_remote_copies",
    "tests/test_docs.py::test_docs_site_builds",
    "tests/test_ray.py",
    "tests/test_fetch.py::test_resets_throttling",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        return next((i for i, prefix in enumerate(SLOW_FIRST) if item.nodeid.startswith(prefix)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order
