"""Resuming an epoch: StatefulDataLoader, a plain DataLoader's resume_state, elastic and chained resumes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest
from torch.utils.data import DataLoader

from shardkit.reading.dataset import StreamingDataset

from readers import ALL_KEYS, WARNINGS, keys_of, loader_of, run, take
from resume import check_save_load, into_dataset, into_dataset_at, resume_state

pytestmark = WARNINGS

try:
    from torchdata.stateful_dataloader import StatefulDataLoader
except ImportError:  # pragma: no cover - torchdata is a test dependency
    StatefulDataLoader = None
needs_torchdata = pytest.mark.skipif(StatefulDataLoader is None, reason="needs torchdata")


class Numbers:
    """Ten samples, its state the count handed out; a resume `slip`s that many samples."""

    def __init__(self, slip: int = 0) -> None:
        self.slip, self.done = slip, 0

    def __iter__(self) -> Iterator[dict[str, str]]:
        while self.done < 10:
            self.done += 1
            yield {"__key__": str(self.done - 1)}

    def state_dict(self) -> dict[str, int]:
        return {"done": self.done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.done = state["done"] + self.slip


@pytest.mark.parametrize("slip, said", [(1, r"missing \[\('3', 1\)\]"), (-1, r"repeated or foreign \[\('2', 1\)\]")])
def test_check_save_load_catches_a_lost_or_a_repeated_sample(slip: int, said: str) -> None:
    assert check_save_load(Numbers, [3, 4], same_order=True).pieces == [list("012"), list("3456"), list("789")]
    with pytest.raises(AssertionError, match=said):
        check_save_load(lambda: Numbers(slip), 3)


def full_epoch(dataset: Path, epoch: int, rank: int = 0, world: int = 1) -> list[str]:
    ds = StreamingDataset(str(dataset), shuffle=True, seed=5, rank=rank, world_size=world)
    ds.set_epoch(epoch)
    return run(ds, 2)


@needs_torchdata
@pytest.mark.parametrize("k", [1, 7])
def test_stateful_dataloader_resume_and_elastic_resume(any_index: Path, k: int) -> None:
    """Two ranks checkpoint after k batches of epoch 3; (a) each resumes with the same layout;
    (b) the checkpoint of one rank resumes the epoch under 3 ranks or 1 rank, other workers."""

    before, states = [], []
    # (a) same layout through StatefulDataLoader, then (d) the next pass is all of epoch 4
    for rank in range(2):
        options = {"rank": rank, "world_size": 2}
        first, then = (
            loader_of(any_index, options, epoch=epoch, stateful=True, num_workers=2, batch_size=5)
            for epoch in (3, None)
        )  # no set_epoch after the checkpoint: the state carries the epoch
        resumed = check_save_load([first, then], k, expected=full_epoch(any_index, 3, rank, 2))
        assert Counter(keys_of(resumed.reader)) == Counter(full_epoch(any_index, 4, rank, 2))
        before.append(resumed.pieces[0])
        states += resumed.states
        assert len(before[rank]) == 5 * k

    done = set(before[0]) | set(before[1])
    assert len(done) == 10 * k
    # (b) elastic: any rank's checkpoint describes all ranks
    for world, workers in ((3, 3), (1, 0)):
        rest = []
        for rank in range(world):
            ds = StreamingDataset(str(any_index), shuffle=True, seed=5, rank=rank, world_size=world)
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
    lagging = loader_of(packed, {"seed": 0}, stateful=True, num_workers=2, batch_size=5, snapshot_every_n_steps=4)
    (state,) = check_save_load(lagging, 6, expected=full_epoch(packed, 0, 0, 1)).states  # the loader's own resume
    with pytest.raises(ValueError, match=r"2 step\(s\) after its last snapshot"):
        StreamingDataset(str(packed), shuffle=True).load_state_dict(state)

    dl = StatefulDataLoader(StreamingDataset(str(packed), shuffle=True), num_workers=2, batch_size=5)
    keys_of(dl)
    fresh = StreamingDataset(str(packed), shuffle=True)
    fresh.load_state_dict({"step": 7, "loader": dl.state_dict()})  # as nested in a training checkpoint
    assert fresh.epoch == 1 and Counter(run(fresh, 3)) == Counter(full_epoch(packed, 1, 0, 1))
    with pytest.raises(ValueError, match="after its last snapshot"):
        StreamingDataset(str(packed), shuffle=True).load_state_dict({"loader": state})


@needs_torchdata
def test_stateful_dataloader_resumes_twice_in_one_epoch(packed: Path) -> None:
    # resumed workers skip what they had yielded; the next state counts both
    resumed = check_save_load(loader_of(packed, stateful=True, num_workers=2, batch_size=5), [3, 4], expected=ALL_KEYS)
    assert [len(piece) for piece in resumed.pieces[:2]] == [15, 20]


@needs_torchdata
def test_chained_elastic_resumes(any_index: Path) -> None:
    layouts = [
        loader_of(any_index, {"seed": 0}, stateful=True, num_workers=2, batch_size=5),
        loader_of(any_index, {"seed": 0}, stateful=True, num_workers=3, batch_size=4),
        loader_of(any_index, {"seed": 0}, num_workers=1, batch_size=None),
    ]
    resumed = check_save_load(layouts, [5, 6], load=into_dataset, expected=ALL_KEYS)
    assert [len(piece) for piece in resumed.pieces[:2]] == [25, 24]


@pytest.mark.parametrize(
    "workers, batch_size, k, new_workers, persistent",
    [(2, 5, 7, 2, False), (3, 7, 16, 3, True), (0, 5, 3, 0, False), (3, 7, 5, 1, False), (1, 8, 2, 3, True)],
)
def test_plain_dataloader_resume_state(
    any_index: Path, workers: int, batch_size: int, k: int, new_workers: int, persistent: bool
) -> None:
    first = loader_of(any_index, epoch=2, num_workers=workers, batch_size=batch_size)
    then = loader_of(any_index, num_workers=new_workers, batch_size=batch_size, persistent_workers=persistent)
    resumed = check_save_load([first, then], k, save=resume_state(epoch=2), load=into_dataset, expected=ALL_KEYS)
    # (d) the resume applies to epoch 2 only: the next pass is the whole of epoch 3
    ref = StreamingDataset(str(any_index), shuffle=True, seed=5)
    ref.set_epoch(3)
    assert keys_of(resumed.reader) == run(ref, new_workers, batch_size)


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


def test_resume_state_across_batching_on_a_dataset_built_as_at_the_checkpoint(packed: Path) -> None:
    """A checkpoint of a batching dataset resumed in one that does not batch: resume_state
    describes the checkpointed run, so it is asked of a dataset built as that one was."""
    batching = loader_of(packed, {"seed": 3, "batch_size": 3}, batch_size=None, num_workers=2)
    plain = loader_of(packed, {"seed": 3}, batch_size=None, num_workers=3)
    check_save_load([batching, plain], 4, save=resume_state(epoch=0), load=into_dataset, expected=ALL_KEYS)


def test_resume_then_a_training_loop_calling_set_epoch(packed: Path) -> None:
    first = loader_of(packed, epoch=2, num_workers=2, batch_size=5)
    then = loader_of(packed, num_workers=2, batch_size=5, persistent_workers=True)
    loader = check_save_load(
        [first, then], 4, save=resume_state(epoch=2), load=into_dataset_at(2), expected=ALL_KEYS
    ).reader
    loader.dataset.set_epoch(3)
    ref = StreamingDataset(str(packed), shuffle=True, seed=5)
    ref.set_epoch(3)
    assert keys_of(loader) == run(ref, 2, 5)


def test_resume_state_under_ddp_ranks(any_index: Path) -> None:
    before = []
    for rank in range(3):
        ds = StreamingDataset(str(any_index), shuffle=True, seed=5, rank=rank, world_size=3)
        before += take(DataLoader(ds, num_workers=2, batch_size=4), 3)
    later = []
    for rank in range(2):
        ds = StreamingDataset(str(any_index), shuffle=True, seed=5, rank=rank, world_size=2)
        ds.load_state_dict(ds.resume_state(epoch=0, samples_seen=12, batch_size=4, num_workers=2, world_size=3))
        later.append(run(ds, 3))
    assert len(later[0]) == len(later[1])
    assert set(before).isdisjoint(later[0] + later[1])
    assert set(before) | set(later[0]) | set(later[1]) == set(ALL_KEYS)


@pytest.mark.parametrize(
    "layouts", [((2, 5, 4), (3, 5, 3), (1, 5, None)), ((0, 8, 2), (2, 4, 5), (2, 8, 1), (3, 4, None))]
)
def test_plain_dataloader_resumes_chain(packed: Path, layouts: tuple[tuple[int, int, int | None], ...]) -> None:
    """A plain DataLoader's resumed pass interrupted again (and again): each state names the
    one its pass resumed from, and the epoch still delivers every sample exactly once."""
    builds = [
        loader_of(packed, epoch=None if i else 2, num_workers=workers, batch_size=batch_size)
        for i, (workers, batch_size, _) in enumerate(layouts)
    ]
    stops = [batches for _, _, batches in layouts[:-1]]
    resumed = check_save_load(builds, stops, save=resume_state(epoch=2), load=into_dataset_at(2), expected=ALL_KEYS)
    json.dumps(resumed.states[-1])  # a checkpoint can hold it
