"""Costs that must not grow with the dataset: open files with thousands of shards under a
low descriptor limit, and a 100-million-sample index built and planned without per-sample
Python objects (memory, counted by tracemalloc; never time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import shardkit
from shardkit.formats.tar_writer import TarWriter

SHARDS = 2000


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2,000 local shards of 3 tiny samples, indexed."""
    folder = tmp_path_factory.mktemp("many")
    for s in range(SHARDS):
        with open(folder / f"part-{s:05d}.tar", "wb") as f:
            writer = TarWriter(f)
            for i in range(3):
                writer.write(f"s{s:05d}i{i}", {"cls": str(i).encode(), "txt": b"x" * (s % 7)})
            writer.close()
    shardkit.index.save(shardkit.build_index(sorted(str(p) for p in folder.glob("*.tar"))), str(folder))
    return folder


UNDER_64 = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from torch.utils.data import DataLoader
from shardkit import StreamingDataset
from shardkit.storage.descriptors import FILES
ds = StreamingDataset(sys.argv[1], shuffle=True, block=1)  # every shard touched, in random order
keys = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=int(sys.argv[2]))]
print(len(keys), len(set(keys)), FILES.limit)
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_thousands_of_local_shards_under_64_descriptors(many: Path, workers: int) -> None:
    """A pass used to keep every shard it touched open until its end: `Too many open files`
    past the limit. The open files are capped at a quarter of the limit, least recently
    used closed first, and a closed one is opened again when next read."""
    run = subprocess.run(
        [sys.executable, "-c", UNDER_64, str(many), str(workers)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [str(3 * SHARDS), str(3 * SHARDS), "16"]


def test_open_files_stay_under_the_limit_and_reopen(many: Path) -> None:
    from shardkit.storage import descriptors

    files = descriptors.Descriptors(limit=5)
    opened: list[str] = []

    def opener(shard: int) -> int:
        opened.append(shard)
        return os.open(many / f"part-{shard:05d}.tar", os.O_RDONLY)

    shards = list(range(8))
    for s in shards + shards[:2]:
        files.release(files.acquire((1, s), lambda s=s: opener(s)))  # type: ignore[misc]
        assert files.count() <= 5
    assert opened == shards + shards[:2]  # the first two were closed, and opened again
    pinned = files.acquire((1, 2), lambda: opener(2))  # a read in progress...
    for s in shards[3:]:  # five more: the pinned one leaves the set
        files.release(files.acquire((1, s), lambda s=s: opener(s)))  # type: ignore[misc]
    assert os.pread(pinned, 10, 0)  # ...keeps its file open though it left the set
    files.release(pinned)
    with pytest.raises(OSError):
        os.fstat(pinned)  # and closes it when done
    files.release(files.acquire((2, 0), lambda: opener(0)))  # another owner's
    files.forget(1)
    assert files.count() == 1


def synthetic(folder: Path, shards: int, per_shard: int) -> Path:
    """A version 2 index of `shards` x `per_shard` samples; its sidecar a sparse file (the
    right size and header, no bytes written: building and planning never read it)."""
    folder.mkdir(parents=True, exist_ok=True)
    entries = shards * (per_shard + 1)
    name = shardkit.index.offsets.name_for((f"shard-{i:06d}.tar", per_shard, 10**9, None) for i in range(shards))
    with open(folder / name, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (entries,)})
        f.truncate(f.tell() + 8 * entries)
    doc = {
        "format": "shardkit",
        "version": 2,
        "kind": "tar",
        "fields": ["cls", "jpg"],
        "offsets": {"file": name, "sha256": "0" * 64},
        "shards": [{"name": f"shard-{i:06d}.tar", "samples": per_shard, "bytes": 10**9} for i in range(shards)],
    }
    (folder / "index.json").write_text(json.dumps(doc))
    return folder


def test_a_hundred_million_samples_build_and_plan_without_per_sample_objects(tmp_path: Path) -> None:
    """100 M samples in 10,000 shards: the dataset, a worker's plan at world size 512 and an
    elastic re-plan from a checkpoint taken under 8 ranks each peak at a few dozen MB (one
    Python int a sample would be 2.8 GB, the epoch as an array 800 MB)."""
    folder = synthetic(tmp_path / "big", 10_000, 10_000)
    tracemalloc.start()
    try:
        ds = shardkit.StreamingDataset(str(folder), shuffle=True, rank=300, world_size=512)
        built = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        ids = ds._pass(300, 512, 3, 8)._plan()
        planned = tracemalloc.get_traced_memory()[1]
        state = ds.resume_state(epoch=0, samples_seen=12_000, batch_size=100, num_workers=8, world_size=8)
        tracemalloc.reset_peak()
        ds.load_state_dict(state)
        resumed = ds._pass(300, 512, 3, 8)._plan()
        replanned = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(ds) == 100_000_000 // 512 + 1
    assert len(ids) == 24_414 and len(np.unique(ids)) == len(ids) and ids.max() < 10**8
    assert len(resumed) < len(ids)
    mb = 1 << 20
    assert built < 20 * mb, built
    assert planned < 40 * mb, planned
    assert replanned < 40 * mb, replanned
