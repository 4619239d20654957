"""StreamingDataset end to end: samples, rank/worker splits, shuffling, resume, bad data."""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import re
import shutil
import tarfile
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import CLASSES, make_folder
from PIL import Image
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptShardError
from shardkit.reading.dataset import StreamingDataset
from shardkit.errors import ShardkitError

pytestmark = [
    # 3 workers on a 2-core runner is deliberate: torch warns, and warnings are errors here
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    # torchdata's StatefulDataLoader calls an API torch deprecated
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

ALL_KEYS = [f"{i:06d}" for i in range(120)]  # the `packed` fixture's keys
SIZE = (48, 40)  # conftest.draw's default image size (W, H)


def keys_of(loader: Any) -> list[str]:
    """Sample keys in the order a loader (or a dataset) yields them, batched or not."""
    out: list[str] = []
    for item in loader:
        k = item["__key__"]
        out += [k] if isinstance(k, str) else list(k)
    return out


def run(ds: StreamingDataset, num_workers: int = 0, batch_size: int | None = None, **kw: Any) -> list[str]:
    return keys_of(DataLoader(ds, num_workers=num_workers, batch_size=batch_size, **kw))


def failure(ds: StreamingDataset, num_workers: int) -> BaseException:
    """The error a pass raises. The loader is dropped at once, without a traceback keeping it
    alive: collected later by the cycle collector, its workers take 5 s each to shut down."""
    it = iter(DataLoader(ds, num_workers=num_workers, batch_size=None))
    try:
        for _ in it:
            pass
    except Exception as e:  # noqa: BLE001
        err = e.with_traceback(None)
        err.__context__ = err.__cause__ = None
    else:
        raise AssertionError("the pass did not fail")
    del it
    return err


def take(loader: Any, batches: int) -> list[str]:
    it = iter(loader)
    return [k for _ in range(batches) for k in next(it)["__key__"]]


def pack(src: Path, dest: Path, **kw: Any) -> Path:
    shardkit.pack(str(src), str(dest), workers=1, progress=False, **kw)
    return dest


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """29 samples in shards of 4: divides by neither 2 nor 3 ranks."""
    root = tmp_path_factory.mktemp("odd")
    src = make_folder(root / "photos", per_class=10)
    (src / "square" / "img_0003.jpg").unlink()
    return pack(src, root / "shards", max_count=4)


def sample_span(dataset: Path, shard: int, sample: int, ext: str) -> tuple[Path, int, int, str]:
    """(shard file, byte offset, size, key) of one member of one sample, from index.json."""
    doc = json.loads((dataset / "index.json").read_text())
    info = doc["shards"][shard]
    path = dataset / info["name"]
    data = path.read_bytes()
    pos, end = info["offsets"][sample], info["offsets"][sample + 1]
    while pos < end:
        name = data[pos : pos + 100].split(b"\0")[0].decode()
        size = int(data[pos + 124 : pos + 135], 8)
        if name.endswith("." + ext):
            return path, pos + 512, size, name.split(".")[0]
        pos += 512 + size + (-size % 512)
    raise AssertionError(f"no .{ext} member in sample {sample} of {path}")


def break_image(dataset: Path, shard: int, sample: int) -> tuple[str, str]:
    """Overwrite one sample's JPEG bytes in place (same size): (shard name, key)."""
    path, pos, size, key = sample_span(dataset, shard, sample, "jpg")
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(b"not a jpeg " * (size // 11) + b"!" * (size % 11))
    return path.name, key


# ---------------------------------------------------------------- samples and decoding


def test_raw_samples_match_the_source_files(packed: Path) -> None:
    photos = packed.parent / "photos"
    ds = StreamingDataset(str(packed))
    samples = list(ds)
    assert [s["__key__"] for s in samples] == ALL_KEYS
    shards = {p.name for p in packed.glob("*.tar")}
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


@pytest.mark.parametrize("options, error, message", [
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
    ({"verify": np.True_, "prefetch_bytes": 0}, ValueError, "prefetch_bytes must be at least 1"),  # a numpy bool is a flag
    ({"transform": "resize"}, TypeError, "transform must be a function (or None), not 'resize'"),
    ({"storage_options": ["anon"]}, TypeError, "storage_options must be a dict (or None), not ['anon']"),
])
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


@pytest.mark.parametrize("state, message", [
    ({"shardkit": 1}, r"not a valid shardkit state \(KeyError: 'epoch'\)"),
    ({"shardkit": 1, "epoch": 1.7}, "epoch must be an integer, not 1.7"),
    ({"shardkit": 1, "epoch": 0, "world_size": 1, "num_workers": 1, "workers": "x"}, "'workers' must be a list"),
    ({"shardkit": 1, "epoch": 0, "world_size": 1, "num_workers": 1, "workers": [{"worker": 1, "yielded": 0}]},
     "worker must be from 0 to 0, not 1"),
    ({"shardkit": 1, "epoch": 0, "world_size": 1, "num_workers": 1, "workers": [{"worker": 0, "yielded": -5}]},
     "yielded must be at least 0, not -5"),
    ({"shardkit": 1, "epoch": 2**64 + 5}, "epoch must be from 0 to"),
    ({"shardkit": 1, "epoch": 0, "order": "x"}, "order must be a dict"),
    ({"shardkit": 1, "epoch": 0, "history": ["x"]}, "a pass's progress is a dict, not 'x'"),
    ({"shardkit": 1, "epoch": 0, "history": [{"foo": 1}]}, r"KeyError: 'world_size'"),
    ({"shardkit": 1, "epoch": 0, "history": [{"world_size": 0, "num_workers": 1, "yielded": [3]}]},
     "world_size 0, num_workers 1, batch 1 and counts \\[3\\] comes from no pass"),
    ({"shardkit": 1, "epoch": 0, "world_size": 1, "num_workers": 2, "workers": [{"worker": 0, "yielded": 3},
                                                                               {"worker": 0, "yielded": 4}]},
     "holds 2 worker states for 2 workers"),
])
def test_malformed_states_are_refused(packed: Path, state: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StreamingDataset(str(packed)).load_state_dict(state)


def test_a_state_of_another_order_is_refused(packed: Path) -> None:
    """Progress counted in one order resumed in another would repeat some samples and lose others."""
    state = StreamingDataset(str(packed), shuffle=True).resume_state(epoch=0, samples_seen=10, batch_size=5,
                                                                     num_workers=1)
    for other, differ in (({"seed": 5}, "seed 0 there, 5 here"), ({"shuffle": False}, "shuffle True there, False here"),
                          ({"block": 8}, "block 64 there, 8 here")):
        with pytest.raises(ValueError, match=f"another order \\({differ}"):
            StreamingDataset(str(packed), **{"shuffle": True, **other}).load_state_dict(state)
    unshuffled = StreamingDataset(str(packed), seed=1).resume_state(epoch=0, samples_seen=10, batch_size=5, num_workers=1)
    StreamingDataset(str(packed), seed=2, block=16).load_state_dict(unshuffled)  # the same order: no shuffle
    with pytest.raises(ValueError, match=r"samples 120 there, \d+ here"):
        StreamingDataset(str(packed / "shard-000000.tar").replace("000000", "{000000..000003}"),
                         shuffle=True).load_state_dict(state)
    for bad in ({"batch_size": -2}, {"batch_size": 0}, {"world_size": 0}, {"num_workers": -3}, {"epoch": 1.5}):
        with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
            StreamingDataset(str(packed)).resume_state(**{"epoch": 0, "samples_seen": 10, "num_workers": 1,
                                                          "batch_size": 5, **bad})


def test_shards_named_one_by_one_take_what_their_folders_index_says(packed: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A brace pattern or a list of a pack's shards costs one read of index.json, not a read
    of every byte; a shard the index does not describe (replaced, or no index) is scanned."""
    from shardkit import sources

    scanned: list[str] = []
    scan_shard = sources.scan_shard
    monkeypatch.setattr(sources, "scan_shard", lambda url, opts=None: scanned.append(url) or scan_shard(url, opts))
    pattern = str(packed / "shard-{000002..000005}.tar")
    ds = StreamingDataset(pattern)
    listed = shardkit.index.load(str(packed)).shards
    assert not scanned and ds.index.classes == tuple(CLASSES)
    assert [(sh.name, sh.sha256) for sh in ds.index.shards] == [(sh.name, sh.sha256) for sh in listed[2:6]]
    assert [s["__key__"] for s in ds] == [s["__key__"] for s in StreamingDataset(sources.expand(pattern))]

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


def test_a_shard_replaced_during_a_run_is_caught_range_by_range(packed: Path, tmp_path: Path) -> None:
    """A repack into the same place while a dataset built on the old index reads on: its
    sample ranges no longer hold whole samples, and each one says so, naming the shard."""
    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    ds = StreamingDataset(str(copy), on_error="skip")
    strict, verified = StreamingDataset(str(copy)), StreamingDataset(str(copy), verify=True)
    shutil.copyfile(packed / "shard-000002.tar", copy / "shard-000001.tar")  # other images: other sizes
    with pytest.raises(CorruptShardError, match=r"shard-000001\.tar.*sample at byte"):
        list(strict)
    with pytest.raises(CorruptShardError, match=r"shard-000001\.tar.*sha256"):
        list(verified)
    keys = [s["__key__"] for s in ds]
    assert len(keys) == len(ds) and 0 < ds.stats()["skipped"] <= 7


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


# ---------------------------------------------------------------- ranks and workers


def check_ranks(per_rank: list[list[str]], everything: list[str], remainder: str, expected_len: int) -> None:
    world = len(per_rank)
    for keys in per_rank:
        assert len(keys) == expected_len
        assert len(set(keys)) == len(keys), "a rank yielded a sample twice"
    union = set().union(*map(set, per_rank))
    assert union <= set(everything)
    if remainder == "repeat":
        assert union == set(everything)
    else:
        assert len(everything) - len(union) < world
        assert sum(map(len, per_rank)) == len(union)


@pytest.mark.parametrize("remainder", ["repeat", "drop"])
@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_yields_len_samples(packed: Path, odd: Path, world: int, num_workers: int, remainder: str) -> None:
    for dataset, total in ((packed, 120), (odd, 29)):
        everything = keys_of(StreamingDataset(str(dataset)))
        assert len(everything) == total
        per_rank = []
        for rank in range(world):
            ds = StreamingDataset(str(dataset), shuffle=True, seed=1, rank=rank, world_size=world, remainder=remainder)
            expected = -(-total // world) if remainder == "repeat" else total // world
            assert len(ds) == expected
            per_rank.append(run(ds, num_workers))
        check_ranks(per_rank, everything, remainder, expected)


@pytest.mark.parametrize("remainder", ["repeat", "drop"])
def test_more_workers_than_shards_and_samples(tmp_path: Path, remainder: str) -> None:
    # 3 samples in 2 shards; 2 ranks of 3 workers each, so some workers have nothing to do
    dataset = pack(make_folder(tmp_path / "photos", per_class=1), tmp_path / "shards", max_count=2)
    everything = keys_of(StreamingDataset(str(dataset)))
    assert len(everything) == 3
    per_rank, batches = [], []
    for rank in range(2):
        ds = StreamingDataset(str(dataset), shuffle=True, rank=rank, world_size=2, remainder=remainder)
        loader = DataLoader(ds, num_workers=3, batch_size=2)
        batches.append(len(list(loader)))
        per_rank.append(keys_of(loader))
    check_ranks(per_rank, everything, remainder, 2 if remainder == "repeat" else 1)
    assert batches[0] == batches[1] > 0


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_len_is_the_per_rank_count(packed: Path, world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(StreamingDataset(str(packed), rank=world - 1, world_size=world)) == -(-120 // world)
    assert len(StreamingDataset(str(packed), rank=0, world_size=world, remainder="drop")) == 120 // world
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert len(StreamingDataset(str(packed))) == -(-120 // world)


def test_construction_and_len_need_only_the_index(packed: Path, tmp_path: Path) -> None:
    only_index = tmp_path / "only-index"
    only_index.mkdir()
    shutil.copy(packed / "index.json", only_index / "index.json")
    ds = StreamingDataset(str(only_index), rank=1, world_size=2, shuffle=True)
    assert len(ds) == 60 and ds.classes == CLASSES
    with pytest.raises(FileNotFoundError, match=r"shard-0000\d\d\.tar"):
        list(ds)


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


# ---------------------------------------------------------------- shuffling and epochs


def test_shuffle_false_yields_key_order(packed: Path) -> None:
    assert keys_of(StreamingDataset(str(packed))) == ALL_KEYS
    assert run(StreamingDataset(str(packed)), 1) == ALL_KEYS
    # two workers: each worker's part is a contiguous run in key order
    keys = run(StreamingDataset(str(packed)), 2)
    assert sorted(keys) == ALL_KEYS
    assert keys[0::2] == ALL_KEYS[:60] and keys[1::2] == ALL_KEYS[60:]


def test_shuffle_is_reproducible_and_depends_on_seed_and_epoch(packed: Path) -> None:
    def order(seed: int, epoch: int | None = None) -> list[str]:
        ds = StreamingDataset(str(packed), shuffle=True, seed=seed)
        if epoch is not None:
            ds.set_epoch(epoch)
        return run(ds, 2)

    a = order(0)
    assert sorted(a) == ALL_KEYS and a != run(StreamingDataset(str(packed)), 2)
    assert order(0) == a == order(0, 0)
    assert order(0, 1) != a and sorted(order(0, 1)) == ALL_KEYS
    assert order(1) != a
    assert order(0, 4) == order(0, 4)


@pytest.mark.parametrize("persistent", [False, True])
def test_each_pass_advances_the_epoch(packed: Path, persistent: bool) -> None:
    ds = StreamingDataset(str(packed), shuffle=True, seed=2)
    loader = DataLoader(ds, num_workers=2, batch_size=None, persistent_workers=persistent)
    passes = [keys_of(loader) for _ in range(3)]
    for epoch, keys in enumerate(passes):
        assert sorted(keys) == ALL_KEYS
        ref = StreamingDataset(str(packed), shuffle=True, seed=2)
        ref.set_epoch(epoch)
        assert keys == run(ref, 2), f"pass {epoch} is not epoch {epoch}"
    assert passes[0] != passes[1] != passes[2]


@pytest.mark.parametrize("persistent", [False, True])
def test_set_epoch_in_the_main_process_reaches_workers(packed: Path, persistent: bool) -> None:
    ds = StreamingDataset(str(packed), shuffle=True, seed=2)
    loader = DataLoader(ds, num_workers=2, batch_size=None, persistent_workers=persistent)
    got = {}
    for epoch in (0, 7, 0, 7):
        ds.set_epoch(epoch)
        keys = keys_of(loader)
        got.setdefault(epoch, keys)
        assert keys == got[epoch]
    assert got[0] != got[7]
    ref = StreamingDataset(str(packed), shuffle=True, seed=2)
    ref.set_epoch(7)
    assert run(ref, 2) == got[7]


@pytest.mark.parametrize("first", ["peek", "two-workers"])
def test_a_pass_after_a_pass_with_other_workers_is_still_one_epoch(packed: Path, first: str) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    if first == "peek":
        assert next(iter(ds))["__key__"] in ALL_KEYS  # look at one sample first
    else:
        run(ds, 2)
    keys = run(ds, 3)
    assert len(keys) == 120
    assert sorted(keys) == ALL_KEYS


def test_state_dict_between_epochs_restores_the_next_epoch(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    loader = DataLoader(ds, num_workers=2, batch_size=None)
    keys_of(loader)
    keys_of(loader)  # two passes: epochs 0 and 1
    third = StreamingDataset(str(packed), shuffle=True)
    third.load_state_dict(ds.state_dict())
    assert run(third, 2) == keys_of(loader)  # both read epoch 2


def test_spawned_workers_see_set_epoch_and_share_stats(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True, seed=4, rank=1, world_size=3)
    loader = DataLoader(ds, num_workers=2, batch_size=None, multiprocessing_context="spawn", persistent_workers=True)
    first = keys_of(loader)
    ds.set_epoch(5)
    second = keys_of(loader)
    ref = StreamingDataset(str(packed), shuffle=True, seed=4, rank=1, world_size=3)
    assert first == run(ref, 2)
    ref.set_epoch(5)
    assert second == run(ref, 2)
    assert first != second and len(first) == len(second) == 40
    stats = ds.stats()
    assert stats["samples"] == 80 and type(stats["samples"]) is int and type(stats["bytes"]) is int


# ---------------------------------------------------------------- resume

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # pragma: no cover - torchdata is a test dependency
    StatefulDataLoader = None
needs_torchdata = pytest.mark.skipif(StatefulDataLoader is None, reason="needs torchdata")


def full_epoch(dataset: Path, epoch: int, rank: int = 0, world: int = 1) -> list[str]:
    ds = StreamingDataset(str(dataset), shuffle=True, seed=5, rank=rank, world_size=world)
    ds.set_epoch(epoch)
    return run(ds, 2)


@needs_torchdata
@pytest.mark.parametrize("k", [1, 7])
def test_stateful_dataloader_resume_and_elastic_resume(packed: Path, k: int) -> None:
    """Two ranks checkpoint after k batches of epoch 3; (a) each resumes with the same layout;
    (b) the checkpoint of one rank resumes the epoch under 3 ranks or 1 rank, other workers."""

    def loader(rank: int) -> tuple[StreamingDataset, Any]:
        ds = StreamingDataset(str(packed), shuffle=True, seed=5, rank=rank, world_size=2)
        return ds, StatefulDataLoader(ds, num_workers=2, batch_size=5)

    before, states = [], []
    for rank in range(2):
        ds, dl = loader(rank)
        ds.set_epoch(3)
        before.append(take(dl, k))
        states.append(dl.state_dict())
        assert len(before[rank]) == 5 * k

    # (a) same layout through StatefulDataLoader, then (d) the next pass is all of epoch 4
    for rank in range(2):
        _, dl = loader(rank)  # no set_epoch: the state carries the epoch
        dl.load_state_dict(states[rank])
        after = keys_of(dl)
        assert Counter(before[rank]) + Counter(after) == Counter(full_epoch(packed, 3, rank, 2))
        assert Counter(keys_of(dl)) == Counter(full_epoch(packed, 4, rank, 2))

    done = set(before[0]) | set(before[1])
    assert len(done) == 10 * k
    # (b) elastic: any rank's checkpoint describes all ranks
    for world, workers in ((3, 3), (1, 0)):
        rest = []
        for rank in range(world):
            ds = StreamingDataset(str(packed), shuffle=True, seed=5, rank=rank, world_size=world)
            ds.load_state_dict(states[rank % 2])
            rest.append(run(ds, workers))
        assert len({len(r) for r in rest}) == 1, "ranks yield different counts after an elastic resume"
        later = [key for r in rest for key in r]
        assert set(later) == set(ALL_KEYS) - done
        assert len(later) - len(set(later)) < world
        for r in rest:
            assert len(set(r)) == len(r)


@needs_torchdata
def test_elastic_resume_refuses_a_lagging_snapshot_and_moves_past_a_finished_pass(packed: Path) -> None:
    """snapshot_every_n_steps > 1 leaves the workers' counts behind the loader: an elastic
    resume from such a state would repeat samples, so it is refused (the loader's own resume
    still works). A state taken after a whole pass resumes at the next epoch, not an empty one."""
    ds = StreamingDataset(str(packed), shuffle=True)
    dl = StatefulDataLoader(ds, num_workers=2, batch_size=5, snapshot_every_n_steps=4)
    before = take(dl, 6)
    state = dl.state_dict()
    with pytest.raises(ValueError, match=r"2 step\(s\) after its last snapshot"):
        StreamingDataset(str(packed), shuffle=True).load_state_dict(state)
    again = StatefulDataLoader(StreamingDataset(str(packed), shuffle=True), num_workers=2, batch_size=5,
                               snapshot_every_n_steps=4)
    again.load_state_dict(state)
    assert Counter(before) + Counter(keys_of(again)) == Counter(full_epoch(packed, 0, 0, 1))

    dl = StatefulDataLoader(StreamingDataset(str(packed), shuffle=True), num_workers=2, batch_size=5)
    keys_of(dl)
    fresh = StreamingDataset(str(packed), shuffle=True)
    fresh.load_state_dict({"step": 7, "loader": dl.state_dict()})  # as nested in a training checkpoint
    assert fresh.epoch == 1 and Counter(run(fresh, 3)) == Counter(full_epoch(packed, 1, 0, 1))
    with pytest.raises(ValueError, match="after its last snapshot"):
        StreamingDataset(str(packed), shuffle=True).load_state_dict({"loader": state})


@needs_torchdata
def test_stateful_dataloader_resumes_twice_in_one_epoch(packed: Path) -> None:
    def loader() -> Any:
        return StatefulDataLoader(StreamingDataset(str(packed), shuffle=True, seed=5), num_workers=2, batch_size=5)

    dl = loader()
    first = take(dl, 3)
    sd = dl.state_dict()
    dl = loader()
    dl.load_state_dict(sd)
    second = take(dl, 4)  # resumed workers skip what they had yielded; the next state counts both
    sd = dl.state_dict()
    dl = loader()
    dl.load_state_dict(sd)
    third = keys_of(dl)
    assert len(first) == 15 and len(second) == 20
    assert Counter(first + second + third) == Counter(ALL_KEYS)


@needs_torchdata
def test_chained_elastic_resumes(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    dl = StatefulDataLoader(ds, num_workers=2, batch_size=5)
    first = take(dl, 5)
    sd = dl.state_dict()
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.load_state_dict(sd)
    dl = StatefulDataLoader(ds, num_workers=3, batch_size=4)
    second = take(dl, 6)
    sd = dl.state_dict()
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.load_state_dict(sd)
    third = run(ds, 1)
    assert Counter(first + second + third) == Counter(ALL_KEYS)
    assert len(first) == 25 and len(second) == 24


@pytest.mark.parametrize(
    "workers, batch_size, k, new_workers, persistent",
    [(2, 5, 7, 2, False), (3, 7, 16, 3, True), (0, 5, 3, 0, False), (3, 7, 5, 1, False), (1, 8, 2, 3, True)],
)
def test_plain_dataloader_resume_state(packed: Path, workers: int, batch_size: int, k: int, new_workers: int,
                                       persistent: bool) -> None:
    ds = StreamingDataset(str(packed), shuffle=True, seed=5)
    ds.set_epoch(2)
    before = take(DataLoader(ds, num_workers=workers, batch_size=batch_size), k)
    ds2 = StreamingDataset(str(packed), shuffle=True, seed=5)
    ds2.load_state_dict(ds2.resume_state(epoch=2, samples_seen=len(before), batch_size=batch_size,
                                         num_workers=workers))
    loader = DataLoader(ds2, num_workers=new_workers, batch_size=batch_size, persistent_workers=persistent)
    after = keys_of(loader)
    assert Counter(before) + Counter(after) == Counter(ALL_KEYS)
    # (d) the resume applies to epoch 2 only: the next pass is the whole of epoch 3
    ref = StreamingDataset(str(packed), shuffle=True, seed=5)
    ref.set_epoch(3)
    assert keys_of(loader) == run(ref, new_workers, batch_size)


def test_resume_state_after_a_whole_pass(packed: Path) -> None:
    """The epoch is done: its resumed pass is empty, the next one is the next epoch, whole,
    with or without the training loop calling set_epoch from the saved epoch on."""
    ref = StreamingDataset(str(packed), shuffle=True, seed=5)
    ref.set_epoch(3)
    whole_epoch_3 = run(ref, 2, 7)
    for calls_set_epoch in (False, True):
        ds = StreamingDataset(str(packed), shuffle=True, seed=5)
        ds.load_state_dict(ds.resume_state(epoch=2, samples_seen=120, batch_size=7, num_workers=2))
        passes = []
        for epoch in (2, 3):
            if calls_set_epoch:
                ds.set_epoch(epoch)
            passes.append(run(ds, 2, 7))
        assert passes == [[], whole_epoch_3]
    with pytest.raises(ValueError, match="samples_seen=121: a pass of this loader hands out 0 to 120 samples"):
        ds.resume_state(epoch=2, samples_seen=121, batch_size=7, num_workers=2)
    with pytest.raises(ValueError, match="samples_seen=10 is not a whole number of batches"):
        ds.resume_state(epoch=2, samples_seen=10, batch_size=7, num_workers=2)


def test_resume_state_after_a_whole_pass_that_dropped_its_last_batches(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True, seed=5)
    whole = sum(len(b) for b in DataLoader(ds, batch_size=7, num_workers=2, drop_last=True, collate_fn=list))
    ds.load_state_dict(ds.resume_state(epoch=0, samples_seen=whole, batch_size=7, num_workers=2, drop_last=True))
    assert whole < 120 and run(ds, 2, 7) == []  # what drop_last dropped is not brought back


def test_states_of_two_loaders_in_one_checkpoint_are_refused(packed: Path) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    train, val = StreamingDataset(str(packed), shuffle=True), StreamingDataset(str(packed))
    loaders = [stateful.StatefulDataLoader(d, batch_size=5, num_workers=2) for d in (train, val)]
    for loader in loaders:
        it = iter(loader)
        next(it)
    checkpoint = {"train_loader": loaders[0].state_dict(), "val_loader": loaders[1].state_dict()}
    with pytest.raises(ValueError, match="holds the states of 2 DataLoaders: pass the state of this dataset's loader"):
        train.load_state_dict(checkpoint)
    train.load_state_dict({"train_loader": loaders[0].state_dict(), "epoch": 3})  # one loader, nested: fine


def test_resume_state_across_batching_on_a_dataset_built_as_at_the_checkpoint(packed: Path) -> None:
    """A checkpoint of a batching dataset resumed in one that does not batch: resume_state
    describes the checkpointed run, so it is asked of a dataset built as that one was."""
    ds = StreamingDataset(str(packed), shuffle=True, seed=3, batch_size=3)
    it = iter(DataLoader(ds, batch_size=None, num_workers=2))
    first = [k for _ in range(4) for k in next(it)["__key__"]]
    del it
    state = StreamingDataset(str(packed), shuffle=True, seed=3, batch_size=3).resume_state(
        epoch=0, samples_seen=len(first), num_workers=2)
    plain = StreamingDataset(str(packed), shuffle=True, seed=3)
    plain.load_state_dict(state)
    rest = [s["__key__"] for s in DataLoader(plain, batch_size=None, num_workers=3)]
    assert Counter(first + rest) == Counter(f"{i:06d}" for i in range(120))


def test_resume_then_a_training_loop_calling_set_epoch(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True, seed=5)
    ds.set_epoch(2)
    before = take(DataLoader(ds, num_workers=2, batch_size=5), 4)
    ds2 = StreamingDataset(str(packed), shuffle=True, seed=5)
    ds2.load_state_dict(ds2.resume_state(epoch=2, samples_seen=20, batch_size=5, num_workers=2))
    loader = DataLoader(ds2, num_workers=2, batch_size=5, persistent_workers=True)
    ds2.set_epoch(2)  # `for epoch in range(start_epoch, epochs): ds.set_epoch(epoch); ...`
    assert Counter(before) + Counter(keys_of(loader)) == Counter(ALL_KEYS)
    ds2.set_epoch(3)
    ref = StreamingDataset(str(packed), shuffle=True, seed=5)
    ref.set_epoch(3)
    assert keys_of(loader) == run(ref, 2, 5)


def test_resume_state_under_ddp_ranks(packed: Path) -> None:
    before = []
    for rank in range(3):
        ds = StreamingDataset(str(packed), shuffle=True, seed=5, rank=rank, world_size=3)
        before += take(DataLoader(ds, num_workers=2, batch_size=4), 3)
    later = []
    for rank in range(2):
        ds = StreamingDataset(str(packed), shuffle=True, seed=5, rank=rank, world_size=2)
        ds.load_state_dict(ds.resume_state(epoch=0, samples_seen=12, batch_size=4, num_workers=2, world_size=3))
        later.append(run(ds, 3))
    assert len(later[0]) == len(later[1])
    assert set(before).isdisjoint(later[0] + later[1])
    assert set(before) | set(later[0]) | set(later[1]) == set(ALL_KEYS)


def test_load_state_dict_rejects_foreign_state(packed: Path) -> None:
    with pytest.raises(ValueError, match="shardkit"):
        StreamingDataset(str(packed)).load_state_dict({"epoch": 3})


# ---------------------------------------------------------------- stats


def test_stats_after_a_pass(packed: Path) -> None:
    ds = StreamingDataset(str(packed), decode="pil")
    keys = run(ds, 2)
    stats = ds.stats()
    assert stats["samples"] == len(keys) == 120
    doc = json.loads((packed / "index.json").read_text())
    assert stats["bytes"] == sum(s["offsets"][-1] - s["offsets"][0] for s in doc["shards"]) > 0
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
def test_workers_freeze_what_they_inherit_and_the_main_process_is_left_alone(packed: Path, batch_size: int | None) -> None:
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


# ---------------------------------------------------------------- shards from other tools


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
    sources: list[Any] = [str(tmp_path / "wds" / "wds-{000000..000004}.tar"), [str(p) for p in shards],
                          str(tmp_path / "wds")]
    for source in sources:
        ds = StreamingDataset(source)
        assert len(ds) == 23
        got = list(ds)
        assert [(s["__key__"], s["jpg"], s["cls"]) for s in got] == samples
        assert Path(got[-1]["__url__"]).name == "wds-000004.tar"
    # index offsets learned from the scan work under ranks and workers too
    per_rank = [run(StreamingDataset(sources[0], shuffle=True, rank=r, world_size=2, decode="rgb8"), 2)
                for r in range(2)]
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
        sink.write({"__key__": "k0", "pyd": payloads["pyd"], "pickle": payloads["pickle"],
                    "pth": torch.arange(4), "cls": 1})
    for mode in ("raw", "pil", "tensor"):
        (s,) = list(StreamingDataset(str(tmp_path / "out"), decode=mode))
        assert s["pyd"] == payloads["pyd"] and s["pickle"] == payloads["pickle"]
        assert isinstance(s["pth"], bytes)
        assert torch.equal(torch.load(io.BytesIO(s["pth"])), torch.arange(4))
        assert s["cls"] == 1
    assert not trap.exists()


# ---------------------------------------------------------------- bad data


def test_truncated_shard_names_the_file(packed: Path, tmp_path: Path) -> None:
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    shard = clone / "shard-000003.tar"
    os.truncate(shard, shard.stat().st_size // 2)
    for workers in (0, 2):
        err = failure(StreamingDataset(str(clone)), workers)
        assert isinstance(err, CorruptShardError) and "shard-000003.tar" in str(err)


def test_scan_messages_name_absolute_positions(packed: Path, tmp_path: Path) -> None:
    """verify on a shard cut inside a member's padding says so (not '1 of 1 bytes
    truncated'); a damaged header read through a sample's range names the member by its
    byte in the shard, as the sample is (not 'sample at byte N at byte 0')."""
    from shardkit import verify

    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    shard = clone / "shard-000001.tar"
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-1]
    os.truncate(shard, last.offset_data + last.size + 1)  # the data whole, its padding cut
    (problem,) = verify(str(clone))
    assert f"member {last.name!r} cut off at byte {last.offset_data + last.size + 1} (its padding: 1 of " in problem
    shutil.copy(packed / shard.name, shard)
    idx = json.loads((clone / "index.json").read_text())
    start = idx["shards"][2]["offsets"][3]
    data = bytearray((clone / "shard-000002.tar").read_bytes())
    data[start + 257 : start + 263] = b"xxxxxx"  # the ustar magic: off the fast path, into the checked one
    (clone / "shard-000002.tar").write_bytes(bytes(data))
    err = failure(StreamingDataset(str(clone)), 0)
    assert f"shard-000002.tar (sample at byte {start}), member at byte {start}: " in str(err), err


def test_member_names_that_are_not_utf8_are_named_errors(tmp_path: Path) -> None:
    """Another tool's tar may carry Latin-1 names: the scan and the indexed fast path both
    say which shard and member, instead of a bare UnicodeDecodeError; an empty file is no
    tar (a failed copy), and a pax record that would loop is refused."""
    folder = tmp_path / "latin"
    folder.mkdir()
    with tarfile.open(folder / "a.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for name in ("ok_.jpg", "ok_.cls"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"123"))
    shardkit.index.save(shardkit.build_index(str(folder / "a.tar")), str(folder))
    data = bytearray((folder / "a.tar").read_bytes())
    data[2] = 0xE9  # "ok\xe9.jpg": Latin-1 for "oké.jpg", and the header's checksum to match
    data[148:156] = b"%06o\0 " % (sum(data[:148]) + sum(data[156:512]) + 8 * ord(" "))
    (folder / "a.tar").write_bytes(bytes(data))
    err = failure(StreamingDataset(str(folder)), 0)
    assert isinstance(err, CorruptShardError) and re.search(r"a\.tar \(sample at byte 0\): the member at byte 0 of the "
                                                            r"sample has a name that is not UTF-8", str(err)), err
    with pytest.raises(CorruptShardError, match=r"a\.tar, member at byte 0: its name b'ok\\xe9\.jpg' is not UTF-8"):
        shardkit.build_index(str(folder / "a.tar"))
    (folder / "b.tar").write_bytes(b"")
    with pytest.raises(CorruptShardError, match=r"b\.tar: an empty file \(0 bytes\), not a tar archive"):
        shardkit.build_index(str(folder / "b.tar"))
    pax = b"0 path=x\n"  # a record length of 0 would never move on
    with tarfile.open(folder / "c.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("PaxHeader")
        info.type, info.size = tarfile.XHDTYPE, len(pax)
        tar.addfile(info, io.BytesIO(pax))
    with pytest.raises(CorruptShardError, match=r"c\.tar, member at byte 0: a malformed pax header record at byte 0"):
        shardkit.build_index(str(folder / "c.tar"))


def test_members_of_a_sample_apart_are_refused_by_the_scan(photos: Path, tmp_path: Path) -> None:
    """`tar cf` in directory order can put a.jpg, b.jpg, a.cls: webdataset makes two half
    samples of `a`; the scan of an index-less shard says what is wrong instead."""
    shard = tmp_path / "plain.tar"
    with tarfile.open(shard, "w") as tar:
        for name in ("a.jpg", "b.jpg", "a.cls", "b.cls"):
            tar.add(photos / "circle" / "img_0000.jpg", name)
    with pytest.raises(CorruptShardError, match=r"plain\.tar: the members of sample 'a' are not adjacent \(more of them "
                                                r"at byte \d+\).*`tar --sort=name`"):
        StreamingDataset(str(shard))
    with tarfile.open(shard, "w") as tar:  # a sample repeated whole (tars concatenated): read as webdataset does
        for name in ("a.jpg", "a.bin", "b.jpg", "b.bin", "a.jpg", "a.bin"):
            tar.add(photos / "circle" / "img_0000.jpg", name)
    assert [s["__key__"] for s in StreamingDataset(str(shard))] == ["a", "b", "a"]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["first member", "image", "after the image"])
def test_truncated_shard_skipped_sample_by_sample(packed: Path, tmp_path: Path, workers: int, where: str) -> None:
    """Under on_error="skip" a cut-off shard loses only the samples past the cut; the rest
    are read, the lost ones replaced and counted. The error says where the shard ends,
    wherever the cut is in the sample (cls, jpg, json members)."""
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    idx = json.loads((clone / "index.json").read_text())
    shard = idx["shards"][3]
    start = shard["offsets"][2]
    _, image, size, _ = sample_span(clone, 3, 2, "jpg")
    with tarfile.open(clone / shard["name"]) as tar:
        member = [n for n in tar.getnames() if n.endswith(".jpg")][2]
    cut, said = {"first member": (start + 700, "cut off, the shard ends at byte {cut}"),
                 "image": (image + 100, "cut off in member '{member}', the shard ends at byte {cut}"),
                 "after the image": (image + size + (-size % 512), "cut off, the shard ends at or before byte {cut}"),
                 }[where]
    os.truncate(clone / shard["name"], cut)
    ds = StreamingDataset(str(clone), on_error="skip")
    keys = run(ds, workers)
    lost = shard["samples"] - 2
    assert len(keys) == len(ds) == 120 and len(set(keys)) == 120 - lost
    assert ds.stats()["skipped"] == lost
    err = failure(StreamingDataset(str(clone)), workers)
    assert isinstance(err, CorruptShardError)
    assert f"{shard['name']} (sample at byte {start}): {said.format(cut=cut, member=member)} (truncated" in str(err)


def test_a_worker_logs_its_first_ten_skips(packed: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    for name in ("shard-000001.tar", "shard-000002.tar"):
        os.truncate(clone / name, 0)
    ds = StreamingDataset(str(clone), on_error="skip")
    with caplog.at_level("WARNING", logger="shardkit"):
        assert len(list(ds)) == 120
    said = [r.getMessage() for r in caplog.records if r.name == "shardkit"]
    assert ds.stats()["skipped"] > 10 and len(said) == 10
    assert all(m.startswith("skipped ") and "cut off" in m for m in said)
    assert said[-1].endswith("(this worker's further skips are counted in stats() only)")


def test_a_shard_truncated_while_read_raises(packed: Path, tmp_path: Path) -> None:
    """A shard cut short in the middle of a pass (rewritten in place by a sync job) raises
    CorruptShardError naming it; a reader of memory maps would die of SIGBUS instead."""
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    stream = iter(StreamingDataset(str(clone)))
    assert next(stream)["__key__"]
    os.truncate(clone / "shard-000000.tar", 1024)
    with pytest.raises(CorruptShardError, match=r"shard-000000\.tar \(sample at byte \d+\): cut off"):
        for _ in stream:
            pass


def test_a_read_error_is_not_skipped_as_bad_data(packed: Path, tmp_path: Path) -> None:
    """A shard that cannot be read (here a folder in its place: pread fails with EISDIR, as a
    failing disk fails with EIO) stops the pass, naming the shard, even under on_error="skip":
    skipping is for bad samples, not for storage that fails."""
    clone = Path(shutil.copytree(packed, tmp_path / "clone"))
    (clone / "shard-000003.tar").unlink()
    (clone / "shard-000003.tar").mkdir()
    for workers in (0, 2):
        err = failure(StreamingDataset(str(clone), on_error="skip"), workers)
        assert type(err) is ShardkitError, err
        assert "shard-000003.tar: reading bytes" in str(err) and "IsADirectoryError" in str(err)


@pytest.fixture
def broken(photos: Path, tmp_path: Path) -> tuple[Path, str, str]:
    """30 samples in shards of 4; the JPEG of sample 1 of shard 2 is garbage."""
    dataset = pack(photos, tmp_path / "shards", max_count=4)
    shard, key = break_image(dataset, 2, 1)
    return dataset, shard, key


def test_undecodable_image_raises_naming_the_shard(broken: tuple[Path, str, str]) -> None:
    dataset, shard, key = broken
    assert len(run(StreamingDataset(str(dataset)), 0)) == 30  # raw bytes are not decoded
    for workers in (0, 2):
        err = failure(StreamingDataset(str(dataset), decode="pil"), workers)
        assert isinstance(err, CorruptShardError) and shard in str(err)


@pytest.mark.parametrize("workers", [0, 2])
def test_undecodable_image_skipped_keeps_the_count(broken: tuple[Path, str, str], workers: int,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    dataset, shard, key = broken
    ds = StreamingDataset(str(dataset), decode="pil", on_error="skip")
    samples = list(DataLoader(ds, num_workers=workers, batch_size=None))
    keys = [s["__key__"] for s in samples]
    assert len(keys) == len(ds) == 30
    assert key not in keys and len(set(keys)) == 29
    assert all(isinstance(s["jpg"], Image.Image) for s in samples)
    assert ds.stats()["skipped"] == 1
    if not workers:  # named in a warning too (a worker's go to its stderr)
        caplog.clear()
        with caplog.at_level("WARNING", logger="shardkit"):
            list(ds)
        (said,) = [r.getMessage() for r in caplog.records if r.name == "shardkit"]
        assert re.match(rf"skipped \S+{re.escape(shard)}: sample {key} at byte \d+: field 'jpg': ", said), said
    # under two ranks as well: both ranks still yield len(ds)
    per_rank, skipped = [], 0
    for rank in range(2):
        ds = StreamingDataset(str(dataset), decode="pil", on_error="skip", shuffle=True, rank=rank, world_size=2)
        per_rank.append(run(ds, workers))
        skipped += ds.stats()["skipped"]
        assert len(per_rank[-1]) == len(ds) == 15
    assert skipped == 1
    assert set(per_rank[0]) | set(per_rank[1]) == {f"{i:06d}" for i in range(30)} - {key}


def test_image_transform_finds_bad_data_as_decode_does(broken: tuple[Path, str, str], tmp_path: Path) -> None:
    """The quickstart's path (decode="raw", image_transform decoding in the transform): an
    undecodable image is named with its shard and sample, and skipped under on_error="skip",
    as with decode="pil"; a bug in the user's own transform is still the user's own error."""
    from shardkit import LMDBDataset
    from shardkit.decode import image_transform

    dataset, shard, key = broken
    augment = image_transform(16, crop=None)
    for workers in (0, 2):
        err = failure(StreamingDataset(str(dataset), transform=augment), workers)
        assert isinstance(err, CorruptShardError) and f"{shard}: sample {key} at byte" in str(err)
        assert "field 'jpg': UnidentifiedImageError: cannot identify an image format in " in str(err)
        assert re.search(r"\d+ bytes starting b'not a jp'", str(err)) and "BytesIO" not in str(err), err
    ds = StreamingDataset(str(dataset), transform=augment, on_error="skip")
    assert len(list(ds)) == 30 and ds.stats()["skipped"] == 1
    # the shard's index entry re-made over the bad bytes, which a conversion then copies (it skips a shard that
    # does not match its index)
    shardkit.index.save(shardkit.build_index(sorted(str(p) for p in dataset.glob("*.tar"))), str(dataset))
    shardkit.pack(str(dataset), str(tmp_path / "db"), format="lmdb", progress=False)
    with pytest.raises(CorruptShardError, match=f"db: sample {key}: field 'jpg': UnidentifiedImageError"):
        [x for x in LMDBDataset(str(tmp_path / "db"), transform=augment)]

    def buggy(sample: dict) -> None:
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        next(iter(StreamingDataset(str(dataset), transform=buggy, on_error="skip")))


def test_skip_keeps_the_count_when_a_worker_has_only_bad_samples(tmp_path: Path) -> None:
    dataset = pack(make_folder(tmp_path / "photos", per_class=1), tmp_path / "shards")
    _, key = break_image(dataset, 0, 1)
    ds = StreamingDataset(str(dataset), decode="pil", on_error="skip")
    keys = run(ds, 3)  # one sample per worker: worker 1 has only the broken one
    assert ds.stats()["skipped"] == 1
    assert len(keys) == len(ds) == 3


def test_skip_then_resume_yields_what_one_pass_yields(tmp_path: Path) -> None:
    """Bad samples at the end of a worker's plan get the same stand-in whether or not the
    pass was resumed just before them."""
    dataset = pack(make_folder(tmp_path / "photos", per_class=3), tmp_path / "shards", shuffle=False)
    break_image(dataset, 0, 7)
    break_image(dataset, 0, 8)

    def stream() -> Any:
        return iter(StreamingDataset(str(dataset), decode="pil", on_error="skip", transform=lambda s: s["__key__"]))

    whole = list(stream())
    first = stream()
    head = [next(first) for _ in range(7)]
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    assert head + list(resumed) == whole and len(whole) == 9


def test_verify_names_a_shard_whose_checksum_is_wrong(tmp_path: Path, packed: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    shard = copy / "shard-000002.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0x20  # inside the first sample's cls payload region: still parses
    shard.write_bytes(bytes(data))
    assert len(list(StreamingDataset(str(copy)))) == 120  # unnoticed without verify
    with pytest.raises(CorruptShardError, match=r"shard-000002\.tar: sha256 mismatch"):
        list(StreamingDataset(str(copy), verify=True))


def test_a_bad_shard_is_hashed_once_and_leaks_no_descriptor(tmp_path: Path, packed: Path) -> None:
    import os
    import shutil

    from shardkit import storage

    copy = tmp_path / "copy"
    shutil.copytree(packed, copy)
    shard = copy / "shard-000000.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0x20
    shard.write_bytes(bytes(data))
    ds = StreamingDataset(str(copy))
    reader = storage.RangeReader(ds.urls, None, [s.sha256 for s in ds.index.shards], verify=True)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(CorruptShardError, match="sha256 mismatch"):
            reader.read(0, 0, 512)
    reader.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_state_dict_counts_the_loaders_passes_not_peeks(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.set_epoch(4)
    next(iter(ds))  # two peeks in the main process...
    next(iter(ds))
    keys_of(DataLoader(ds, num_workers=2, batch_size=None))  # ...then one epoch with workers
    assert ds.state_dict()["epoch"] == 5


def test_a_resume_point_is_dropped_when_another_epoch_is_set(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.load_state_dict(ds.resume_state(epoch=2, samples_seen=10, batch_size=5, num_workers=1))
    ds.set_epoch(3)
    ds.set_epoch(2)  # back to 2: a full epoch now, not the old partial one
    assert len(keys_of(DataLoader(ds, num_workers=1, batch_size=None))) == 120


@pytest.mark.parametrize("persistent", [False, True])
def test_a_resume_point_applies_once_even_if_its_epoch_is_set_again(packed: Path, persistent: bool) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.load_state_dict(ds.resume_state(epoch=2, samples_seen=10, batch_size=5, num_workers=2))
    loader = DataLoader(ds, num_workers=2, batch_size=5, persistent_workers=persistent)
    ds.set_epoch(2)
    assert len(keys_of(loader)) == 110
    ds.set_epoch(2)  # the same epoch again (a second look at it): whole this time
    assert len(keys_of(loader)) == 120


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("set_epoch", [False, True])
def test_a_peek_after_loading_a_resume_point_leaves_it_to_the_loader(packed: Path, workers: int,
                                                                      set_epoch: bool) -> None:
    """The main process's passes are a layout of their own, even beside one worker."""
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.set_epoch(2)
    before = take(DataLoader(ds, num_workers=workers, batch_size=5), 2)
    ds2 = StreamingDataset(str(packed), shuffle=True)
    ds2.load_state_dict(ds2.resume_state(epoch=2, samples_seen=10, batch_size=5, num_workers=workers))
    next(iter(ds2))  # a look at one sample's shape
    assert ds2.state_dict()["epoch"] == 2  # a peek is no pass that a checkpoint counts
    if set_epoch:
        ds2.set_epoch(2)  # the training loop's
    rest = keys_of(DataLoader(ds2, num_workers=workers, batch_size=5))
    assert len(rest) == 110 and Counter(before) + Counter(rest) == Counter(ALL_KEYS)
    assert ds2.state_dict()["epoch"] == 3


def test_state_dict_after_the_loaders_passes_and_a_peek(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    loader = DataLoader(ds, num_workers=2, batch_size=None)
    for _ in range(3):
        keys_of(loader)
    next(iter(ds))  # a peek in the main process sets nothing the loader's next pass follows
    assert ds.state_dict()["epoch"] == 3
    in_main = DataLoader(ds, num_workers=0, batch_size=None)  # whole passes in the main process do
    for _ in range(3):
        keys_of(in_main)
    assert ds.state_dict()["epoch"] == 4  # the peek was this layout's first pass


@pytest.mark.parametrize("workers, left", [(2, 120), (0, 110)])
def test_an_interrupted_resumed_pass(packed: Path, workers: int, left: int) -> None:
    """A pass with workers uses the resume point up as it starts (they read ahead: how far
    the trainer got is not theirs to know); one in the main process only at its end."""
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.load_state_dict(ds.resume_state(epoch=2, samples_seen=10, batch_size=5, num_workers=2))
    ds.set_epoch(2)
    next(iter(DataLoader(ds, num_workers=workers, batch_size=5)))  # interrupted after a batch
    ds.set_epoch(2)
    assert len(keys_of(DataLoader(ds, num_workers=workers, batch_size=5))) == left


def test_a_copy_finds_its_rank_where_it_runs(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a spawned worker's pickle pins the rank: a copy made before DDP starts (a
    framework's deepcopy at setup) sees the rank and world size that come later."""
    import copy

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = StreamingDataset(str(packed))
    early = copy.deepcopy(ds)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert len(ds) == len(early) == len(copy.deepcopy(ds)) == 60


def test_a_state_is_refused_by_the_same_samples_cut_into_other_shards(tmp_path: Path) -> None:
    photos = make_folder(tmp_path / "photos", per_class=4)
    a = pack(photos, tmp_path / "a", max_count=3)
    b = pack(photos, tmp_path / "b", max_count=5)
    state = StreamingDataset(str(a), shuffle=True).resume_state(epoch=0, samples_seen=4, batch_size=2, num_workers=0)
    with pytest.raises(ValueError, match=r"another order \(shard_sizes '4 shards, sha256 \w+' there, '3 shards"):
        StreamingDataset(str(b), shuffle=True).load_state_dict(state)
    StreamingDataset(str(b)).load_state_dict(  # in the dataset's own order the cut does not matter
        StreamingDataset(str(a)).resume_state(epoch=0, samples_seen=4, batch_size=2, num_workers=0))


def test_resume_state_of_a_batching_dataset_takes_no_drop_last(packed: Path) -> None:
    ds = StreamingDataset(str(packed), batch_size=4)
    with pytest.raises(ValueError, match="the dataset batches by 4: leave drop_last out"):
        ds.resume_state(epoch=0, samples_seen=8, num_workers=2, drop_last=True)


def test_loading_a_state_after_persistent_workers_started_is_refused(packed: Path) -> None:
    """Persistent workers keep the dataset they were started with: a resume point loaded
    later would silently not reach them, so their next pass refuses, in the main process."""
    ds = StreamingDataset(str(packed), shuffle=True)
    loader = DataLoader(ds, num_workers=2, batch_size=5, persistent_workers=True)
    assert len(keys_of(loader)) == 120
    ds.load_state_dict(ds.resume_state(epoch=3, samples_seen=10, batch_size=5, num_workers=2))
    with pytest.raises(RuntimeError, match="load_state_dict was called after this DataLoader's persistent workers"):
        keys_of(loader)
    fresh = DataLoader(ds, num_workers=2, batch_size=5)  # a new loader gets the resume point
    assert len(keys_of(fresh)) == 110


def test_the_stand_in_for_bad_samples_leaves_transform_errors_alone(tmp_path: Path) -> None:
    """on_error="skip" skips bad data, never the user's own exceptions, even where a stand-in
    sample is searched for (a plan with only bad samples left)."""
    dataset = pack(make_folder(tmp_path / "photos", per_class=1), tmp_path / "shards")
    break_image(dataset, 0, 1)

    def boom(sample: dict[str, Any]) -> Any:
        raise KeyError("a bug in the transform")

    ds = StreamingDataset(str(dataset), decode="pil", on_error="skip", transform=boom, rank=1, world_size=3,
                          remainder="drop")  # rank 1's only sample is the broken one
    with pytest.raises(KeyError, match="a bug in the transform"):
        run(ds)


def test_every_bit_of_the_seed_counts(packed: Path) -> None:
    orders = [run(StreamingDataset(str(packed), shuffle=True, seed=s)) for s in (7, 7 + 2**32, 7 + 2**64)]
    assert len({tuple(o) for o in orders}) == 3


@pytest.mark.parametrize("layouts", [((2, 5, 4), (3, 5, 3), (1, 5, None)), ((0, 8, 2), (2, 4, 5), (2, 8, 1), (3, 4, None))])
def test_plain_dataloader_resumes_chain(packed: Path, layouts: tuple[tuple[int, int, int | None], ...]) -> None:
    """A plain DataLoader's resumed pass interrupted again (and again): each state names the
    one its pass resumed from, and the epoch still delivers every sample exactly once."""
    delivered: list[str] = []
    state = None
    for workers, batch_size, batches in layouts:
        ds = StreamingDataset(str(packed), shuffle=True, seed=5)
        if state is not None:
            ds.load_state_dict(state)
        ds.set_epoch(2)
        loader = DataLoader(ds, num_workers=workers, batch_size=batch_size)
        got = take(loader, batches) if batches is not None else keys_of(loader)
        delivered += got
        if batches is not None:
            state = ds.resume_state(epoch=2, samples_seen=len(got), batch_size=batch_size, num_workers=workers,
                                    resumed_from=state)
    assert Counter(delivered) == Counter(ALL_KEYS)
    json.dumps(state)  # a checkpoint can hold it


def test_resume_state_after_a_resumed_pass_needs_resumed_from(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.load_state_dict(ds.resume_state(epoch=1, samples_seen=10, batch_size=5, num_workers=1))
    with pytest.raises(ValueError, match="pass that state as resumed_from"):
        ds.resume_state(epoch=1, samples_seen=10, batch_size=5, num_workers=1)
    other = ds.resume_state(epoch=2, samples_seen=10, batch_size=5, num_workers=1)
    with pytest.raises(ValueError, match="resumed_from is not a resume state of epoch 1"):
        ds.resume_state(epoch=1, samples_seen=10, batch_size=5, num_workers=1, resumed_from=other)
