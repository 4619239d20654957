"""StreamingDataset(batch_size=B): batches made in the worker, in shared memory reused only
after the main process freed every tensor over it."""

from __future__ import annotations

import gc
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import shardkit
from shardkit.reading import batching, segments, shared_batch
from shardkit.reading.dataset import StreamingDataset

from readers import ALL_KEYS, loader_of
from resume import check_save_load, into_dataset, resume_state

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


def to_pair(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return sample["jpg"], sample["cls"]


def with_key(sample: dict[str, Any]) -> dict[str, Any]:
    """A dict transform: the image, the label, the key and a float and numpy leaf."""
    return {
        "image": sample["jpg"],
        "label": sample["cls"],
        "key": sample["__key__"],
        "weight": 0.5,
        "mean": sample["jpg"].float().mean((1, 2)).numpy(),
    }


def reference(packed: Path) -> dict[str, tuple[torch.Tensor, int]]:
    """key -> (image, label), read one sample at a time."""
    return {s["__key__"]: (s["jpg"], s["cls"]) for s in StreamingDataset(str(packed), decode="tensor")}


def batched(packed: Path, batch: int, **kw: Any) -> StreamingDataset:
    return StreamingDataset(str(packed), decode="tensor", transform=with_key, batch_size=batch, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_hold_what_dataloader_batching_would(packed: Path, workers: int) -> None:
    ref = reference(packed)
    plain = next(iter(DataLoader(StreamingDataset(str(packed), decode="tensor", transform=with_key), batch_size=8)))
    loader = DataLoader(batched(packed, 8, shuffle=True), batch_size=None, num_workers=workers)
    keys = []
    for batch in loader:
        assert batch.keys() == plain.keys()
        for name in ("image", "label", "weight", "mean"):
            assert batch[name].dtype == plain[name].dtype and batch[name].shape[1:] == plain[name].shape[1:]
        assert isinstance(batch["key"], list)
        for i, key in enumerate(batch["key"]):
            image, label = ref[key]
            assert torch.equal(batch["image"][i], image) and batch["label"][i] == label
            assert batch["weight"][i] == 0.5
        keys += batch["key"]
    assert Counter(keys) == Counter(ref.keys())


@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_len_counts_batches_and_only_the_last_is_short(packed: Path, world: int, workers: int) -> None:
    seen = []
    for rank in range(world):
        ds = StreamingDataset(
            str(packed), transform=to_pair, decode="tensor", batch_size=7, rank=rank, world_size=world, shuffle=True
        )
        sizes = [len(x) for x, _ in DataLoader(ds, batch_size=None, num_workers=workers)]
        assert len(sizes) == len(ds) == -(-120 // world // 7)
        assert sorted(sizes)[1:] == [7] * (len(sizes) - 1)
        seen.append(sum(sizes))
    assert seen == [120 // world] * world


def test_kept_batches_and_views_are_never_overwritten(packed: Path) -> None:
    """More batches kept than the pool has segments, and views outliving their batch."""
    ref = reference(packed)
    ds = StreamingDataset(str(packed), decode="tensor", transform=to_pair, batch_size=4, shuffle=True)
    kept, views = [], []
    for images, labels in DataLoader(ds, batch_size=None, num_workers=2):
        if len(kept) < segments.MAX_SEGMENTS + 4:
            kept.append((images, labels))
        else:
            views.append((images[1:3], labels[1:3].clone()))  # the batch itself is dropped here
        del images, labels
        gc.collect(0)  # the youngest objects: a full collection costs 0.3 s in a big test process
    assert len(kept) + len(views) == 30
    for images, labels in kept:
        keys = _keys(ref, images)
        assert all(torch.equal(img, ref[k][0]) for img, k in zip(images, keys))
        assert labels.tolist() == [ref[k][1] for k in keys]
    for images, labels in views:
        for img, label in zip(images, labels):
            matches = [k for k, (r, lab) in ref.items() if torch.equal(r, img)]
            assert matches and ref[matches[0]][1] == label


def _keys(ref: dict[str, tuple[torch.Tensor, int]], images: torch.Tensor) -> list[str]:
    return [next(k for k, (r, _) in ref.items() if torch.equal(r, img)) for img in images]


def test_segments_are_reused_once_freed(packed: Path) -> None:
    pool = segments.process_pool()
    pool.segments.clear()
    ds = StreamingDataset(str(packed), decode="tensor", transform=to_pair, batch_size=8)
    for batch in DataLoader(ds, batch_size=None):
        del batch
    gc.collect()
    assert not any(s.busy for s in pool.segments)
    assert len(pool.segments) <= 2  # the batch in hand and the one being filled
    held = next(iter(DataLoader(ds, batch_size=None)))
    view = held[0][0]
    del held
    gc.collect()
    busy = [s for s in pool.segments if s.busy]
    assert len(busy) == 1, "a view keeps its batch's segment busy"
    del view
    gc.collect()
    assert not any(s.busy for s in pool.segments)


@pytest.mark.parametrize("proc", [True, False])
def test_both_ways_of_opening_a_workers_segment(packed: Path, monkeypatch: pytest.MonkeyPatch, proc: bool) -> None:
    """The /proc path (Linux), and multiprocessing's descriptor passing (elsewhere)."""
    monkeypatch.setattr(shared_batch, "_PROC_FD", proc)
    ref = reference(packed)
    ds = StreamingDataset(str(packed), decode="tensor", transform=to_pair, batch_size=16)
    kept = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert sum(len(x) for x, _ in kept) == 120
    for images, _ in kept:
        assert all(torch.equal(img, ref[k][0]) for img, k in zip(images, _keys(ref, images)))


def test_spawned_and_persistent_workers(packed: Path) -> None:
    ds = StreamingDataset(str(packed), decode="tensor", transform=to_pair, batch_size=16, shuffle=True)
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="spawn")
    ref = reference(packed)
    for epoch in range(2):
        ds.set_epoch(epoch)
        labels = Counter()
        for images, lab in loader:
            for k, y in zip(_keys(ref, images), lab.tolist()):
                assert ref[k][1] == y
                labels[y] += 1
        assert labels == {0: 40, 1: 40, 2: 40}


def megabyte_and_pid(sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return torch.full((256, 1024), float(sample["cls"])), os.getpid()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssShmem from /proc")
def test_a_worker_does_not_map_the_batches_it_handed_over(packed: Path) -> None:
    """A worker writes its batches through the segment's descriptor: the batches held in the
    main process (and the ones queued) count in the worker's RSS not at all (they did, twice
    over, when the worker wrote them through its mapping)."""
    ds = StreamingDataset(str(packed), decode="tensor", transform=megabyte_and_pid, batch_size=16)
    batches = iter(DataLoader(ds, batch_size=None, num_workers=1))
    held = [next(batches) for _ in range(5)]  # 16 MB each, the worker alive with two more queued
    assert all(torch.equal(x[i], torch.full((256, 1024), float(x[i, 0, 0]))) for x, _ in held for i in range(16))
    pid = int(held[0][1][0])
    status = Path(f"/proc/{pid}/status").read_text()
    shared_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssShmem:")))
    assert shared_kb < 4096, f"the worker maps {shared_kb} KB of shared memory with 7 batches of 16 MB out"
    del batches


def shape_by_class(sample: dict[str, Any]) -> torch.Tensor:
    return torch.zeros(2 + sample["cls"], 3)


@pytest.mark.parametrize("workers", [0, 1])
def test_samples_that_cannot_be_stacked_raise_a_clear_error(packed: Path, workers: int) -> None:
    ds = StreamingDataset(str(packed), transform=shape_by_class, batch_size=120)
    with pytest.raises(ValueError, match=r"batch_size=120: cannot stack sample \d+ .*torch.float32 of shape \(\d, 3\)"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=workers)))


def test_collate_of_nothing() -> None:
    with pytest.raises(ValueError, match="collate needs at least one sample"):
        shardkit.collate([])


def test_invalid_batch_size(packed: Path) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        StreamingDataset(str(packed), batch_size=0)
    ds = StreamingDataset(str(packed), batch_size=5)
    with pytest.raises(ValueError, match="batches by 5"):
        ds.resume_state(epoch=0, samples_seen=10, batch_size=4, num_workers=2)


def test_plain_dataloader_resume_of_a_batched_dataset(packed: Path) -> None:
    options = {"decode": "tensor", "transform": with_key, "batch_size": 6, "seed": 3}
    first, then = (loader_of(packed, options, epoch=epoch, batch_size=None, num_workers=3) for epoch in (2, None))
    resumed = check_save_load(
        [first, then],
        5,
        save=resume_state(epoch=2),
        load=into_dataset,
        expected=ALL_KEYS,
        keys=lambda batch: batch["key"],
    )
    assert len(resumed.pieces[0]) == 30


def test_stateful_dataloader_resume_of_a_batched_dataset(packed: Path) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    batched = loader_of(
        packed,
        {"decode": "tensor", "transform": with_key, "batch_size": 6, "seed": 3},
        stateful=True,
        batch_size=None,
        num_workers=2,
    )
    check_save_load(batched, 3, expected=ALL_KEYS, keys=lambda batch: batch["key"])
    # elastic: the same checkpoint resumed without batching and another worker count
    plain = loader_of(packed, {"seed": 3}, batch_size=None, num_workers=3)
    check_save_load(
        [batched, plain],
        3,
        load=into_dataset,
        expected=ALL_KEYS,
        keys=lambda item: item["key"] if "key" in item else [item["__key__"]],
    )


def test_numbers_and_other_leaves_collate_like_default_collate() -> None:
    samples = [({"a": np.full((2,), i, np.int16), "b": (i, float(i), bool(i % 2)), "c": f"s{i}"}) for i in range(5)]
    stream = iter(samples)
    got = next(batching.Batches(stream, 5))
    want = torch.utils.data.default_collate(samples)
    assert torch.equal(got["a"], want["a"]) and got["a"].dtype == torch.int16
    for g, w in zip(got["b"], want["b"]):
        assert torch.equal(g, w) and g.dtype == w.dtype
    assert list(got["c"]) == list(want["c"])


@pytest.mark.parametrize("workers", [0, 2])
def test_collate_is_a_drop_in_for_map_style_datasets(packed: Path, tmp_path: Path, workers: int) -> None:
    import shardkit

    lmdb = tmp_path / "photos.lmdb"
    shardkit.pack(str(packed), str(lmdb), format="lmdb", progress=False)
    ds = shardkit.LMDBDataset(str(lmdb), decode="tensor", transform=with_key)
    ref = reference(packed)
    got = Counter()
    kept = []
    for batch in DataLoader(ds, batch_size=16, shuffle=True, num_workers=workers, collate_fn=shardkit.collate):
        want = torch.utils.data.default_collate(
            [with_key({"jpg": ref[k][0], "cls": ref[k][1], "__key__": k}) for k in batch["key"]]
        )
        assert batch.keys() == want.keys()
        for name in ("image", "label", "weight", "mean"):
            assert torch.equal(batch[name], want[name]) and batch[name].dtype == want[name].dtype
        got.update(batch["key"])
        kept.append((batch["image"], list(batch["key"])))
    assert got == Counter(ref.keys())
    for images, keys in kept:  # every batch was kept: none was written over
        assert all(torch.equal(img, ref[k][0]) for img, k in zip(images, keys))


def test_empty_bool_complex_strided_and_lazy_leaves_stack_like_default_collate() -> None:
    samples = [
        (
            torch.zeros((0, 4)),
            np.array([i % 2 == 0, True]),
            np.full(3, 1j * i, np.complex64),
            torch.arange(6).reshape(2, 3).T + i,
            torch.full((2,), 1 + 1j * i).conj() if i else torch.ones(2) + 0j,
            torch._neg_view(torch.arange(3.0) + i) if i else torch.arange(3.0),
        )
        for i in range(4)
    ]
    got, want = next(batching.Batches(iter(samples), 4)), torch.utils.data.default_collate(samples)
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.dtype == w.dtype and g.shape == w.shape


def test_mixed_numbers_and_key_order_collate_like_default_collate() -> None:
    samples = [{"w": 0, "x": 1.5, "y": True}, {"y": 1, "x": 2, "w": 0.5}, {"x": 3.0, "w": 1, "y": False}]
    got, want = next(batching.Batches(iter(samples), 3)), torch.utils.data.default_collate(samples)
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]) and got[key].dtype == want[key].dtype


@pytest.mark.parametrize(
    "values",
    [
        [5, torch.tensor(7)],
        [0.5, np.float64(0.25)],
        [1, 2, torch.tensor(3)],  # numbers first: default_collate takes 0-d ones
        [torch.tensor(7), 5],
        [torch.tensor(7), 5, 6],  # a 0-d tensor first: it refuses a number after it
    ],
)
def test_numbers_beside_0d_tensors_collate_like_default_collate(values: list) -> None:
    samples = [(v,) for v in values]
    try:
        want = torch.utils.data.default_collate(samples)
    except TypeError:
        with pytest.raises(ValueError, match=r"cannot stack sample 1 of a batch: field \[0\] is int"):
            next(batching.Batches(iter(samples), len(samples)))
        return
    got = next(batching.Batches(iter(samples), len(samples)))
    assert torch.equal(got[0], want[0]) and got[0].dtype == want[0].dtype


def test_a_batch_unpickled_twice_keeps_its_buffer_until_both_are_freed() -> None:
    import pickle

    monkey = pytest.MonkeyPatch()
    monkey.setattr(shared_batch, "_PROC_FD", True)
    try:
        samples = [torch.full((4,), i) for i in range(3)]
        layout_batch = batching.Batches(iter(samples), 3)
        layout_batch._in_worker = True
        shared = next(layout_batch)
        seg = shared.seg
        blob = pickle.dumps(shared)
        first, second = pickle.loads(blob), pickle.loads(blob)
        del shared
        assert seg.busy
        del first
        gc.collect()
        assert seg.busy, "the second copy is still alive"
        assert torch.equal(second[2], torch.full((4,), 2))
        del second
        gc.collect()
        assert not seg.busy
    finally:
        monkey.undo()


def test_a_dataloader_batching_a_batching_dataset_says_so(packed: Path) -> None:
    ds = StreamingDataset(str(packed), decode="tensor", transform=to_pair, batch_size=4)
    with pytest.raises(TypeError, match="the dataset batches already .*give the DataLoader batch_size=None"):
        next(iter(DataLoader(ds, batch_size=2, num_workers=1)))


def test_strings_and_paths_collate_as_default_collate_does() -> None:
    """Values that are not stacked come back in default_collate's containers: a tuple (zip's)
    inside a tuple or list, a list inside a dict or at the top; a stacking error names the
    field by its place in the sample."""
    samples = [(torch.zeros(2), i, f"k{i}", {"name": f"n{i}", "id": i}) for i in range(3)]
    want = torch.utils.data.default_collate(samples)
    got = next(batching.Batches(iter(samples), 3))
    assert got[2] == want[2] == ("k0", "k1", "k2") and got[3]["name"] == want[3]["name"] == ["n0", "n1", "n2"]
    assert next(batching.Batches(iter(["a", "b"]), 2)) == torch.utils.data.default_collate(["a", "b"]) == ["a", "b"]
    nested = [{"meta": {"id": i}, "image": torch.zeros(2 + (i == 1))} for i in range(2)]
    with pytest.raises(
        ValueError, match=r"sample 1 of a batch: field \['image'\] is torch.float32 of shape \(3,\), in"
    ):
        next(batching.Batches(iter(nested), 2))
    with pytest.raises(
        ValueError,
        match=r"sample 1 of a batch: the sample is torch.float32 of shape \(2,\) that "
        r"requires grad, in the batch's first sample it is float32 of shape \(2,\)",
    ):
        next(batching.Batches(iter([torch.zeros(2), torch.zeros(2, requires_grad=True)]), 2))
    with pytest.raises(TypeError, match="collate takes a list of samples, not dict: give the DataLoader a batch_size"):
        shardkit.collate({"image": torch.zeros(2)})
