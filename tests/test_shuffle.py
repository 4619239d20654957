"""Shuffling and epochs: reproducible from (seed, epoch), each pass the next epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from shardkit.reading.dataset import StreamingDataset

from readers import ALL_KEYS, WARNINGS, keys_of, run

pytestmark = WARNINGS


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


def test_every_bit_of_the_seed_counts(packed: Path) -> None:
    orders = [run(StreamingDataset(str(packed), shuffle=True, seed=s)) for s in (7, 7 + 2**32, 7 + 2**64)]
    assert len({tuple(o) for o in orders}) == 3
