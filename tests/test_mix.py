"""Mixing datasets by weight: exact counts, per-part epoch semantics, equal ranks, resume."""

from __future__ import annotations

import collections
from typing import Callable

import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import StreamingDataset
from shardkit.order import partition

from resume import check_save_load, into_dataset, resume_state

from conftest import make_folder


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("mix")
    a = shardkit.pack(
        str(make_folder(root / "a", per_class=10)), str(root / "A"), max_count=7, workers=1, progress=False
    )
    b = shardkit.pack(
        str(make_folder(root / "b", per_class=4)), str(root / "B"), format="lmdb", workers=1, progress=False
    )
    assert (a.samples, b.samples) == (30, 12)
    return str(root / "A"), str(root / "B")


def tagged(ds, workers: int = 0, batch: int | None = None) -> list[tuple[str, str]]:  # type: ignore[no-untyped-def]
    loader = DataLoader(ds, batch_size=None, num_workers=workers)
    return [("A" if s["__url__"].endswith(".tar") else "B", s["__key__"]) for s in loader]


def test_mix_counts_are_exact_and_proportional() -> None:
    assert partition.mix_counts([0.7, 0.3], 80).tolist() == [56, 24]
    assert partition.mix_counts([1, 1, 1], 10).sum() == 10
    assert partition.mix_counts([0.5, 0.7], 54).tolist() == [22, 32]  # ties broken as they always were
    with pytest.raises(ValueError):
        partition.mix_counts([1, 0], 10)
    spread, draws = partition.mix_order([6, 2], seed=0, epoch=0, shuffle=False).at(0, 8)
    assert spread.tolist() == [0, 0, 1, 0, 0, 0, 1, 0]  # as it always was
    assert draws.tolist() == [0, 1, 0, 2, 3, 4, 1, 5]
    shuffled, draws = partition.mix_order([6, 2], seed=0, epoch=0, shuffle=True).at(0, 8)
    assert sorted(shuffled.tolist()) == [0] * 6 + [1] * 2
    assert draws[shuffled == 0].tolist() == list(range(6))  # each part's draws in order


def test_each_part_runs_through_its_own_epochs(two: tuple[str, str]) -> None:
    a, b = two
    mix = StreamingDataset.mix([(a, 0.25), (b, 0.75)], samples_per_epoch=40, shuffle=True, seed=3)
    assert mix.counts.tolist() == [10, 30]
    seen: dict[str, list[str]] = collections.defaultdict(list)
    for epoch in range(3):
        mix.set_epoch(epoch)
        got = tagged(mix, workers=2)
        assert len(got) == len(mix) == 40
        assert collections.Counter(t for t, _ in got) == {"A": 10, "B": 30}
        for t, k in got:
            seen[t].append(k)
    # A (30 samples, 10 per mixture epoch): three mixture epochs are one A epoch, each sample once
    assert sorted(seen["A"]) == sorted(set(seen["A"])) and len(seen["A"]) == 30
    # B (12 samples, 30 per mixture epoch): 90 draws are 7.5 B epochs, each sample 7 or 8 times
    assert set(collections.Counter(seen["B"]).values()) <= {7, 8} and len(set(seen["B"])) == 12


def test_ranks_get_equal_counts_and_cover_the_mixture(two: tuple[str, str]) -> None:
    a, b = two
    per_rank = []
    every: collections.Counter[tuple[str, str]] = collections.Counter()
    for rank in range(3):
        mix = StreamingDataset.mix([(a, 0.6), (b, 0.4)], shuffle=True, seed=1, rank=rank, world_size=3)
        got = tagged(mix, workers=2)
        per_rank.append(len(got))
        every.update(got)
    assert per_rank == [14, 14, 14]  # 42 positions over 3 ranks
    reference = StreamingDataset.mix([(a, 0.6), (b, 0.4)], shuffle=True, seed=1)
    assert every == collections.Counter(tagged(reference))  # the same epoch, split three ways


def test_deterministic_and_resumable(two: tuple[str, str]) -> None:
    a, b = two

    def loader(workers: int, epoch: int | None = None) -> Callable[[], DataLoader]:
        def build() -> DataLoader:
            mix = StreamingDataset.mix([(a, 0.5), (b, 0.5)], shuffle=True, seed=5)
            if epoch is not None:
                mix.set_epoch(epoch)
            return DataLoader(mix, batch_size=5, num_workers=workers, collate_fn=list)

        return build

    def tags(batch: list[dict]) -> list[tuple[str, str]]:
        return [("A" if s["__url__"].endswith(".tar") else "B", s["__key__"]) for s in batch]

    full = [x for batch in loader(2, epoch=2)() for x in tags(batch)]
    assert full == [x for batch in loader(2, epoch=2)() for x in tags(batch)]
    # resumed under another num_workers: elastic
    check_save_load(
        [loader(2, epoch=2), loader(1)], 2, save=resume_state(epoch=2), load=into_dataset, expected=full, keys=tags
    )


def test_a_state_of_a_mix_whose_parts_have_another_order_is_refused(two: tuple[str, str]) -> None:
    a, b = two
    state = StreamingDataset.mix([(a, 0.5), (b, 0.5)], shuffle=True, block=2).resume_state(
        epoch=0, samples_seen=10, batch_size=5, num_workers=1
    )
    for other in (
        StreamingDataset.mix([(a, 0.5), (b, 0.5)], shuffle=True, block=64),
        StreamingDataset.mix(
            [
                (StreamingDataset(a, shuffle=True, seed=9, block=2), 0.5),
                (StreamingDataset(b, shuffle=True, block=2), 0.5),
            ],
            shuffle=True,
        ),
    ):
        with pytest.raises(ValueError, match="whose epochs have another order .*parts"):
            other.load_state_dict(state)
    for part in state["order"]["parts"]:  # as shardkit saved it before it recorded the shards' counts
        del part["shard_sizes"]
    StreamingDataset.mix([(a, 0.5), (b, 0.5)], shuffle=True, block=2).load_state_dict(state)
    del state["order"]["parts"]  # as shardkit saved it before it recorded the parts' order
    StreamingDataset.mix([(a, 0.5), (b, 0.5)], shuffle=True, block=2).load_state_dict(state)


def test_a_mix_can_batch_in_its_workers(two: tuple[str, str]) -> None:
    a, b = two

    def mix(**kw):  # type: ignore[no-untyped-def]
        return StreamingDataset.mix([(a, 0.6), (b, 0.4)], shuffle=True, seed=1, **kw)

    batched = mix(batch_size=4)
    assert len(batched) == 11  # 42 samples in batches of 4
    loader = DataLoader(batched, batch_size=None, num_workers=2)
    batches = [list(zip(batch["__url__"], batch["__key__"])) for batch in loader]
    assert sorted(map(len, batches)) == [2] + [4] * 10  # only the rank's last batch is short
    got = [("A" if url.endswith(".tar") else "B", key) for batch in batches for url, key in batch]
    assert collections.Counter(got) == collections.Counter(tagged(mix()))
    with pytest.raises(ValueError, match="give batch_size to the mix"):
        StreamingDataset.mix([(StreamingDataset(a, batch_size=2), 1.0)])


def test_mix_arguments_fail_at_once_naming_them(two: tuple[str, str]) -> None:
    a, b = two
    for parts, options, error, message in [
        ([(a, 1)], {"samples_per_epoch": 0}, ValueError, "samples_per_epoch must be at least 1, not 0"),
        ([(a, 1)], {"samples_per_epoch": 2.5}, TypeError, "samples_per_epoch must be an integer"),
        ([(a, 1), (b, 1e-300)], {}, ValueError, r"part 1 \(weight 1e-300\) gets no sample in an epoch of 42"),
        ([(a, float("nan"))], {}, ValueError, "a mix weight is a positive finite number, not nan"),
        ([(a, "a")], {}, ValueError, "a mix weight is a positive finite number, not 'a'"),
        ([a], {}, TypeError, "each part of a mix is a \\(dataset, weight\\) pair"),
        ([(a, 1)], {"shuffle_window": 0}, ValueError, "shuffle_window must be at least 1, not 0"),
        ([(a, 1)], {"remainder": "bogus"}, ValueError, "remainder must be one of"),
        (
            [(StreamingDataset(a), 1)],
            {"decode": "tensor"},
            ValueError,
            r"options for the parts \(decode\) apply to parts "
            "given as URLs",
        ),
    ]:
        with pytest.raises(error, match=message):
            StreamingDataset.mix(parts, **options)
    huge = StreamingDataset.mix([(a, 1e308), (b, 1e308)])  # their sum overflows a float
    assert huge.counts.tolist() == [21, 21]
