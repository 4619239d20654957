"""Rank and worker splitting: every rank yields len(ds) samples, each sample once per epoch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import CLASSES, make_folder
from torch.utils.data import DataLoader

import shardkit
from shardkit import CorruptShardError
from shardkit.reading.dataset import StreamingDataset

from readers import WARNINGS, check_ranks, keys_of, pack, run

pytestmark = WARNINGS


@pytest.fixture(scope="module")
def odd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """29 samples in shards of 4: divides by neither 2 nor 3 ranks."""
    root = tmp_path_factory.mktemp("odd")
    src = make_folder(root / "photos", per_class=10)
    (src / "square" / "img_0003.jpg").unlink()
    return pack(src, root / "shards", max_count=4)


@pytest.mark.parametrize("remainder", ["repeat", "drop"])
@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_yields_len_samples(
    any_index: Path, odd: Path, world: int, num_workers: int, remainder: str
) -> None:
    for dataset, total in ((any_index, 120), (odd, 29)):
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
    side = shardkit.index.load(str(packed)).offsets_file.file
    with pytest.raises(CorruptShardError, match=rf"only-index/{side}: no such file, and index.json names it"):
        StreamingDataset(str(only_index))
    shutil.copy(packed / side, only_index / side)
    ds = StreamingDataset(str(only_index), rank=1, world_size=2, shuffle=True)
    assert len(ds) == 60 and ds.classes == CLASSES
    with pytest.raises(FileNotFoundError, match=r"shard-0000\d\d\.tar"):
        list(ds)


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
