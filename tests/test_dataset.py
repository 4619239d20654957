"""StreamingDataset end to end: samples, decoding, arguments, sources, stats, worker processes."""

from __future__ import annotations

import copy
import io
import os
import pickle
import re
import shutil
import tarfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CLASSES, shard_offsets
from PIL import Image
from torch.utils.data import DataLoader

import shardkit
from shardkit.reading.dataset import StreamingDataset

from readers import ALL_KEYS, SIZE, WARNINGS, keys_of, run

pytestmark = WARNINGS


def test_raw_samples_match_the_source_files(any_index: Path) -> None:
    photos = any_index.parent / "photos"
    ds = StreamingDataset(str(any_index))
    samples = list(ds)
    assert [s["__key__"] for s in samples] == ALL_KEYS
    shards = {p.name for p in any_index.glob("*.tar")}
    per_class = Counter()
    for s in samples:
        assert set(s) == {"__key__", "__url__", "jpg", "cls", "json"}
        assert Path(s["__url__"]).name in shards and os.path.exists(s["__url__"])
        assert isinstance(s["cls"], int) and isinstance(s["json"], dict)
        assert set(s["json"]) == {"path", "class"}
        assert s["json"]["class"] == CLASSES[s["cls"]]
        assert s["json"]["path"].startswith(s["json"]["class"] + "/")
        assert isinstance(s["jpg"], bytes)
        assert s["jpg"] == (photos / s["json"]["path"]).read_bytes()
        per_class[s["cls"]] += 1
    assert per_class == {0: 40, 1: 40, 2: 40}
    assert len({s["json"]["path"] for s in samples}) == 120


@pytest.mark.parametrize("mode", ["pil", "rgb8", "tensor"])
def test_decode_modes(packed: Path, mode: str) -> None:
    photos = packed.parent / "photos"
    ds = StreamingDataset(str(packed), decode=mode)
    samples = list(ds)
    assert len(samples) == 120
    for s in samples:
        with Image.open(photos / s["json"]["path"]) as im:
            expected = np.array(im.convert("RGB"))
        img = s["jpg"]
        assert isinstance(s["cls"], int) and isinstance(s["json"], dict)
        if mode == "pil":
            assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == SIZE
            assert np.array_equal(np.array(img), expected)
        elif mode == "rgb8":
            assert isinstance(img, np.ndarray) and img.dtype == np.uint8
            assert img.shape == (SIZE[1], SIZE[0], 3) and img.flags.writeable
            assert np.array_equal(img, expected)
            img[0, 0] = 0  # writable for in-place augmentation
        else:
            assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8
            assert tuple(img.shape) == (3, SIZE[1], SIZE[0])
            assert torch.equal(img, torch.from_numpy(expected).permute(2, 0, 1))


def test_invalid_arguments_raise_value_error(packed: Path) -> None:
    with pytest.raises(ValueError, match="decode"):
        StreamingDataset(str(packed), decode="jpeg")
    with pytest.raises(ValueError, match="on_error"):
        StreamingDataset(str(packed), on_error="ignore")
    with pytest.raises(ValueError, match="remainder"):
        StreamingDataset(str(packed), remainder="pad")


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"seed": 1.5}, TypeError, "seed must be an integer, not 1.5"),
        ({"seed": None}, TypeError, "seed must be an integer, not None"),
        ({"block": 0}, ValueError, "block must be at least 1, not 0"),
        ({"shuffle_window": "3"}, TypeError, "shuffle_window must be an integer, not '3'"),
        ({"batch_size": True}, TypeError, "batch_size must be an integer, not True"),
        ({"prefetch": -1}, ValueError, "prefetch must be at least 0, not -1"),
        ({"prefetch_bytes": 0}, ValueError, "prefetch_bytes must be at least 1 bytes, not 0"),
        ({"prefetch_bytes": 1.5}, TypeError, "prefetch_bytes: not a size: 1.5"),
        ({"cache_limit": "lots"}, ValueError, "cache_limit: not a size: 'lots'"),
        ({"rank": 2, "world_size": 2}, ValueError, "rank 2 is outside world size 2"),
        ({"rank": 1.5, "world_size": 2}, TypeError, "rank must be an integer, not 1.5"),
        ({"rank": 0, "world_size": 0}, ValueError, "world_size must be at least 1, not 0"),
        ({"shuffle": "false"}, TypeError, "shuffle must be True or False, not 'false'"),
        ({"verify": 1}, TypeError, "verify must be True or False, not 1"),
        (
            {"verify": np.True_, "prefetch_bytes": 0},
            ValueError,
            "prefetch_bytes must be at least 1",
        ),  # a numpy bool is a flag
        ({"transform": "resize"}, TypeError, "transform must be a function (or None), not 'resize'"),
        ({"storage_options": ["anon"]}, TypeError, "storage_options must be a dict (or None), not ['anon']"),
    ],
)
def test_wrong_values_fail_at_once_naming_the_argument(packed: Path, options: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        StreamingDataset(str(packed), **options)


def test_sources_and_epochs_of_the_wrong_kind(packed: Path) -> None:
    assert len(StreamingDataset(packed)) == len(StreamingDataset([*sorted(packed.glob("*.tar"))])) == 120  # Paths
    for source in (StreamingDataset(str(packed)), b"x", 3):
        with pytest.raises(TypeError, match="source must be a dataset folder or URL"):
            StreamingDataset(source)  # type: ignore[arg-type]
    ds = StreamingDataset(str(packed))
    for epoch in (-1, 2**32):  # 2**32 epochs: past any run, and a mixture's counts stay inside 64 bits
        with pytest.raises(ValueError, match="epoch must be from 0 to 4294967295"):
            ds.set_epoch(epoch)
    with pytest.raises(TypeError, match="epoch must be an integer, not 1.0"):
        ds.set_epoch(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="the environment variable RANK='abc' is not an integer"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("RANK", "abc")
            len(ds)


def test_shards_named_one_by_one_take_what_their_folders_index_says(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A brace pattern or a list of a pack's shards costs one read of index.json, not a read
    of every byte; a shard the index does not describe (replaced, or no index) is scanned."""
    from shardkit.index import resolve

    scanned: list[str] = []
    scan_shard = resolve.scan_shard
    monkeypatch.setattr(resolve, "scan_shard", lambda url, opts=None: scanned.append(url) or scan_shard(url, opts))
    pattern = str(packed / "shard-{000002..000005}.tar")
    ds = StreamingDataset(pattern)
    listed = shardkit.index.load(str(packed)).shards
    assert not scanned and ds.index.classes == tuple(CLASSES)
    assert [(sh.name, sh.sha256) for sh in ds.index.shards] == [(sh.name, sh.sha256) for sh in listed[2:6]]
    assert [s["__key__"] for s in ds] == [s["__key__"] for s in StreamingDataset(resolve.expand(pattern))]

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    with tarfile.open(copy / "shard-000003.tar", "w") as tar:  # replaced by another tool's shard
        for key in ("p", "q"):
            info = tarfile.TarInfo(f"{key}.cls")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"7"))
    ds = StreamingDataset([str(copy / "shard-000002.tar"), str(copy / "shard-000003.tar")])
    assert scanned == [str(copy / "shard-000003.tar")] and len(ds) == listed[2].samples + 2 and ds.index.classes == ()
    assert [s["__key__"] for s in ds][-2:] == ["p", "q"]
    (copy / "index.json").unlink()
    StreamingDataset(str(copy / "shard-{000000..000001}.tar"))
    assert scanned[1:] == [str(copy / "shard-000000.tar"), str(copy / "shard-000001.tar")]


def to_pair(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return sample["jpg"], sample["cls"]


def test_transform_output_goes_through_a_batching_dataloader(packed: Path) -> None:
    ds = StreamingDataset(str(packed), decode="tensor", transform=to_pair, shuffle=True)
    labels = []
    sizes = []
    for x, y in DataLoader(ds, num_workers=2, batch_size=8):
        assert x.dtype == torch.uint8 and tuple(x.shape[1:]) == (3, SIZE[1], SIZE[0])
        assert y.dtype == torch.int64 and tuple(y.shape) == (len(x),)
        labels += y.tolist()
        sizes.append(len(x))
    assert sizes == [8] * 14 + [4, 4]  # each worker: 60 samples = 7 batches of 8 and one of 4
    assert Counter(labels) == {0: 40, 1: 40, 2: 40}


@pytest.mark.parametrize("batch_size", [None, 4])
def test_breaking_out_of_the_loop_closes_the_shards(packed: Path, batch_size: int | None) -> None:
    """A pass left halfway closes its files at once, not at the next full garbage collection."""
    import gc

    ds = StreamingDataset(str(packed), shuffle=True, batch_size=batch_size)

    def passes(n: int) -> int:
        for _ in range(n):
            for j, _ in enumerate(DataLoader(ds, batch_size=None)):
                if j == 2:
                    break
        return len(os.listdir("/proc/self/fd"))

    gc.disable()
    try:
        before = passes(1)  # batches: the process's reusable buffers exist from here on
        assert passes(20) <= before
    finally:
        gc.enable()


def test_pickle_is_small_and_round_trips(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True, seed=3, rank=1, world_size=2)
    ds.set_epoch(4)
    blob = pickle.dumps(ds)
    assert len(blob) < 200_000
    clones = [pickle.loads(blob), copy.deepcopy(ds)]
    expected = keys_of(ds)  # epoch 4, rank 1 of 2
    assert len(expected) == 60
    for clone in clones:
        assert len(clone) == 60 and clone.epoch == 4
        assert keys_of(clone) == expected
    # a copy is a snapshot: it does not share the original's epoch counters
    ds.set_epoch(9)
    assert clones[0].epoch == 4


def test_stats_after_a_pass(packed: Path) -> None:
    ds = StreamingDataset(str(packed), decode="pil")
    keys = run(ds, 2)
    stats = ds.stats()
    assert stats["samples"] == len(keys) == 120
    assert stats["bytes"] == sum(t[-1] - t[0] for t in shard_offsets(packed).values()) > 0
    assert stats["skipped"] == 0
    assert stats["decode_s"] > 0 and 0 <= stats["read_fraction"] <= 1


def test_a_slow_disk_shows_as_reading_not_decoding(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local shard's bytes are read while the sample is taken out of it: that time is
    reading, or a data-bound loader would look decode-bound."""
    import time

    from shardkit import storage

    read_at = storage.RangeReader.read_at

    def slow(self, shard):  # type: ignore[no-untyped-def]
        fast = read_at(self, shard)
        return lambda size, offset: time.sleep(0.002) or fast(size, offset)

    monkeypatch.setattr(storage.RangeReader, "read_at", slow)
    ds = StreamingDataset(str(packed))
    assert len(list(ds)) == 120
    stats = ds.stats()
    assert stats["read_s"] > 120 * 0.002 and stats["read_fraction"] > 0.5, stats


def frozen_objects(sample: dict[str, Any]) -> int:
    import gc

    return gc.get_freeze_count()


@pytest.mark.parametrize("batch_size", [None, 4])
def test_workers_freeze_what_they_inherit_and_the_main_process_is_left_alone(
    packed: Path, batch_size: int | None
) -> None:
    """A worker's full garbage collection must not walk (and copy-on-write) the main
    process's objects: it delayed the first batch by ~140 ms. The user's own process keeps
    its garbage collector as it was."""
    import gc

    before = gc.get_freeze_count()
    ds = StreamingDataset(str(packed), transform=frozen_objects, batch_size=batch_size)

    def counts(items: Any) -> set[int]:
        return {int(x) for item in items for x in torch.as_tensor(item).reshape(-1)}

    assert min(counts(DataLoader(ds, num_workers=2, batch_size=None))) > 10_000  # torch alone is far more
    assert counts(ds) == {before} == {gc.get_freeze_count()}


def _frozen_at_start(worker_id: int) -> None:
    import gc

    assert gc.get_freeze_count() > 10_000, "a worker's first collection could walk the main process's objects"


def test_workers_are_frozen_from_the_fork_on(packed: Path) -> None:
    """Frozen before torch's own worker set-up runs (a worker_init_fn sees it): where the
    main process's collection counters sit at their thresholds at the fork, the worker's
    first allocations run a full collection before any code of the dataset's (+100 ms on
    the first batch, found after an unrelated change moved those counters)."""
    ds = StreamingDataset(str(packed))
    assert len(keys_of(DataLoader(ds, num_workers=1, batch_size=None, worker_init_fn=_frozen_at_start))) == 120


def test_spawned_workers_freeze_at_their_first_sample(packed: Path) -> None:
    """Not forked, no fork hook: a spawned worker imported torch itself, and freezes that."""
    ds = StreamingDataset(str(packed), transform=frozen_objects)
    counts = list(DataLoader(ds, num_workers=1, batch_size=None, multiprocessing_context="spawn"))
    assert min(counts) > 10_000
