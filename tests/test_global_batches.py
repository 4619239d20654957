"""StreamingDataset(global_batch_size=B) with real DataLoader workers: the same global
batches whatever the world size and num_workers, ranks' slices side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from shardkit import StreamingDataset

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
B = 12
OPTIONS: dict[str, Any] = {"shuffle": True, "seed": 4, "global_batch_size": B, "block": 4, "shuffle_window": 24}


def rank_batches(
    packed: Path, rank: int, world: int, workers: int, own_batches: bool = False, **options: Any
) -> list[list[str]]:
    opts = {**OPTIONS, **options}
    if own_batches:
        ds = StreamingDataset(str(packed), rank=rank, world_size=world, batch_size=B // world, **opts)
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
    else:
        ds = StreamingDataset(str(packed), rank=rank, world_size=world, **opts)
        assert ds.local_batch_size == B // world
        loader = DataLoader(ds, batch_size=ds.local_batch_size, num_workers=workers)
    batches = [list(batch["__key__"]) for batch in loader]
    assert len(batches) == len(ds) // (1 if own_batches else B // world)
    return batches


def global_batches(packed: Path, world: int, workers: int, **options: Any) -> list[list[str]]:
    per_rank = [rank_batches(packed, r, world, workers, **options) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1  # every rank hands over the same number of batches
    return [sum(slices, []) for slices in zip(*per_rank)]


def test_every_layout_gives_the_batches_of_one_rank_and_no_workers(packed: Path) -> None:
    whole = global_batches(packed, 1, 0)
    assert len(whole) == 10 and all(len(b) == B for b in whole)
    assert sorted(k for b in whole for k in b) == [f"{i:06d}" for i in range(120)]
    assert whole != global_batches(packed, 1, 0, seed=5)
    for world, workers in ((1, 3), (2, 2), (3, 1), (4, 3), (6, 2), (12, 1)):
        assert global_batches(packed, world, workers) == whole, (world, workers)
    assert global_batches(packed, 2, 3, own_batches=True) == whole  # batched by the workers themselves


def test_a_mixture_in_global_batches(packed: Path) -> None:
    def mixed(rank: int, world: int, workers: int) -> list[list[str]]:
        mix = StreamingDataset.mix(
            [(str(packed), 1.0), (str(packed), 2.0)],
            shuffle=True,
            seed=2,
            rank=rank,
            world_size=world,
            global_batch_size=B,
            samples_per_epoch=96,
            block=4,
        )
        return [list(b["__key__"]) for b in DataLoader(mix, batch_size=mix.local_batch_size, num_workers=workers)]

    whole = mixed(0, 1, 0)
    assert len(whole) == 8
    for world, workers in ((2, 3), (4, 1)):
        per_rank = [mixed(r, world, workers) for r in range(world)]
        assert [sum(s, []) for s in zip(*per_rank)] == whole


def test_a_world_size_that_does_not_divide_the_global_batch(packed: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"global_batch_size=12 does not split evenly over world size 5: use a "
        r"world size that divides it \(1, 2, 3, 4, 6, 12\)",
    ):
        StreamingDataset(str(packed), rank=0, world_size=5, **OPTIONS)
    with pytest.raises(
        ValueError,
        match=r"batch_size=4 with global_batch_size=12 over 2 ranks: each rank's "
        r"batches hold 6 samples",
    ):
        StreamingDataset(str(packed), rank=0, world_size=2, batch_size=4, **OPTIONS)
    ds = StreamingDataset(str(packed), rank=0, world_size=2, **OPTIONS)
    with pytest.raises(
        ValueError,
        match=r"batch_size=4: under global_batch_size=12 over 2 ranks the DataLoader's "
        r"batch_size is 6",
    ):
        ds.resume_state(epoch=0, samples_seen=8, num_workers=1, batch_size=4)


def test_bad_samples_skipped_the_same_under_every_layout(tmp_path: Path) -> None:
    """on_error="skip": a bad sample's place goes to the next usable sample by id, whoever
    reads it, so the global batches stay those of one rank and no workers."""
    from conftest import make_folder
    from readers import break_image, pack

    dataset = pack(make_folder(tmp_path / "photos", per_class=8), tmp_path / "shards", max_count=5)
    keys = [break_image(dataset, shard, i)[1] for shard, i in ((0, 1), (2, 4), (3, 0))]
    options = {**OPTIONS, "decode": "rgb8", "on_error": "skip"}
    whole = global_batches(dataset, 1, 0, **options)
    flat = [k for b in whole for k in b]
    assert len(whole) == 2 and not set(keys) & set(flat) and len(set(flat)) == 21
    for world, workers in ((2, 3), (3, 2), (4, 1)):
        assert global_batches(dataset, world, workers, **options) == whole


def test_a_mixture_resumed_under_another_layout_continues_its_batches(packed: Path) -> None:
    def mix(rank: int, world: int) -> Any:
        return StreamingDataset.mix(
            [(str(packed), 1.0), (str(packed), 2.0)],
            shuffle=True,
            seed=2,
            rank=rank,
            world_size=world,
            global_batch_size=B,
            samples_per_epoch=96,
            block=4,
        )

    whole = [list(b["__key__"]) for b in DataLoader(mix(0, 1), batch_size=B)]
    first = [mix(r, 2) for r in range(2)]
    head = [[list(b["__key__"]) for b, _ in zip(DataLoader(m, batch_size=6, num_workers=2), range(3))] for m in first]
    saved = first[0].resume_state(epoch=0, samples_seen=18, num_workers=2, batch_size=6)
    rest = []
    for rank in range(3):  # 3 ranks of 4 samples a batch, one worker each
        m = mix(rank, 3)
        m.load_state_dict(saved)
        rest.append([list(b["__key__"]) for b in DataLoader(m, batch_size=4, num_workers=1)])
    got = [a + b for a, b in zip(*head)] + [sum(parts, []) for parts in zip(*rest)]
    assert got == whole
