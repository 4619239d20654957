"""State dicts: malformed or foreign states refused, epochs counted, resume points under set_epoch and peeks."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_folder
from torch.utils.data import DataLoader

from shardkit.reading.dataset import StreamingDataset

from readers import ALL_KEYS, WARNINGS, keys_of, loader_of, pack
from resume import check_save_load, resume_state

pytestmark = WARNINGS


@pytest.mark.parametrize(
    "state, message",
    [
        ({"shardkit": 1}, r"not a valid shardkit state \(KeyError: 'epoch'\)"),
        ({"shardkit": 1, "epoch": 1.7}, "epoch must be an integer, not 1.7"),
        ({"shardkit": 1, "epoch": 0, "world_size": 1, "num_workers": 1, "workers": "x"}, "'workers' must be a list"),
        (
            {"shardkit": 1, "epoch": 0, "world_size": 1, "num_workers": 1, "workers": [{"worker": 1, "yielded": 0}]},
            "worker must be from 0 to 0, not 1",
        ),
        (
            {"shardkit": 1, "epoch": 0, "world_size": 1, "num_workers": 1, "workers": [{"worker": 0, "yielded": -5}]},
            "yielded must be at least 0, not -5",
        ),
        ({"shardkit": 1, "epoch": 2**64 + 5}, "epoch must be from 0 to"),
        ({"shardkit": 1, "epoch": 0, "order": "x"}, "order must be a dict"),
        ({"shardkit": 1, "epoch": 0, "history": ["x"]}, "a pass's progress is a dict, not 'x'"),
        ({"shardkit": 1, "epoch": 0, "history": [{"foo": 1}]}, r"KeyError: 'world_size'"),
        (
            {"shardkit": 1, "epoch": 0, "history": [{"world_size": 0, "num_workers": 1, "yielded": [3]}]},
            "world_size 0, num_workers 1, batch 1 and counts \\[3\\] comes from no pass",
        ),
        (
            {
                "shardkit": 1,
                "epoch": 0,
                "world_size": 1,
                "num_workers": 2,
                "workers": [{"worker": 0, "yielded": 3}, {"worker": 0, "yielded": 4}],
            },
            "holds 2 worker states for 2 workers",
        ),
    ],
)
def test_malformed_states_are_refused(packed: Path, state: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StreamingDataset(str(packed)).load_state_dict(state)


def test_a_state_of_another_order_is_refused(packed: Path) -> None:
    """Progress counted in one order resumed in another would repeat some samples and lose others."""
    state = StreamingDataset(str(packed), shuffle=True).resume_state(
        epoch=0, samples_seen=10, batch_size=5, num_workers=1
    )
    for other, differ in (
        ({"seed": 5}, "seed 0 there, 5 here"),
        ({"shuffle": False}, "shuffle True there, False here"),
        ({"block": 8}, "block 64 there, 8 here"),
    ):
        with pytest.raises(ValueError, match=f"another order \\({differ}"):
            StreamingDataset(str(packed), **{"shuffle": True, **other}).load_state_dict(state)
    unshuffled = StreamingDataset(str(packed), seed=1).resume_state(
        epoch=0, samples_seen=10, batch_size=5, num_workers=1
    )
    StreamingDataset(str(packed), seed=2, block=16).load_state_dict(unshuffled)  # the same order: no shuffle
    first_generation = {**state, "order": {k: v for k, v in state["order"].items() if k != "shuffle_version"}}
    with pytest.raises(ValueError, match=r"shuffled order differs from this one's \(shuffle version 1, here 2\)"):
        StreamingDataset(str(packed), shuffle=True).load_state_dict(first_generation)  # shardkit 0.1's
    old_unshuffled = {**unshuffled, "order": {k: v for k, v in unshuffled["order"].items() if k != "shuffle_version"}}
    StreamingDataset(str(packed)).load_state_dict(old_unshuffled)  # its own order then as now
    with pytest.raises(ValueError, match=r"samples 120 there, \d+ here"):
        StreamingDataset(
            str(packed / "shard-000000.tar").replace("000000", "{000000..000003}"), shuffle=True
        ).load_state_dict(state)
    for bad in ({"batch_size": -2}, {"batch_size": 0}, {"world_size": 0}, {"num_workers": -3}, {"epoch": 1.5}):
        with pytest.raises((TypeError, ValueError), match=next(iter(bad))):
            StreamingDataset(str(packed)).resume_state(
                **{"epoch": 0, "samples_seen": 10, "num_workers": 1, "batch_size": 5, **bad}
            )


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


def test_load_state_dict_rejects_foreign_state(packed: Path) -> None:
    with pytest.raises(ValueError, match="shardkit"):
        StreamingDataset(str(packed)).load_state_dict({"epoch": 3})


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
def test_a_peek_after_loading_a_resume_point_leaves_it_to_the_loader(
    packed: Path, workers: int, set_epoch: bool
) -> None:
    """The main process's passes are a layout of their own, even beside one worker."""

    def load_and_peek(loader: DataLoader, state: dict) -> DataLoader:
        ds = loader.dataset
        ds.load_state_dict(state)
        next(iter(ds))  # a look at one sample's shape
        assert ds.state_dict()["epoch"] == 2  # a peek is no pass that a checkpoint counts
        if set_epoch:
            ds.set_epoch(2)  # the training loop's
        return loader

    first, then = (
        loader_of(packed, {"seed": 0}, epoch=epoch, num_workers=workers, batch_size=5) for epoch in (2, None)
    )
    resumed = check_save_load([first, then], 2, save=resume_state(epoch=2), load=load_and_peek, expected=ALL_KEYS)
    assert len(resumed.pieces[1]) == 110 and resumed.reader.dataset.state_dict()["epoch"] == 3


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


def test_a_state_is_refused_by_the_same_samples_cut_into_other_shards(tmp_path: Path) -> None:
    photos = make_folder(tmp_path / "photos", per_class=4)
    a = pack(photos, tmp_path / "a", max_count=3)
    b = pack(photos, tmp_path / "b", max_count=5)
    state = StreamingDataset(str(a), shuffle=True).resume_state(epoch=0, samples_seen=4, batch_size=2, num_workers=0)
    with pytest.raises(ValueError, match=r"another order \(shard_sizes '4 shards, sha256 \w+' there, '3 shards"):
        StreamingDataset(str(b), shuffle=True).load_state_dict(state)
    StreamingDataset(str(b)).load_state_dict(  # in the dataset's own order the cut does not matter
        StreamingDataset(str(a)).resume_state(epoch=0, samples_seen=4, batch_size=2, num_workers=0)
    )


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


def test_resume_state_after_a_resumed_pass_needs_resumed_from(packed: Path) -> None:
    ds = StreamingDataset(str(packed), shuffle=True)
    ds.load_state_dict(ds.resume_state(epoch=1, samples_seen=10, batch_size=5, num_workers=1))
    with pytest.raises(ValueError, match="pass that state as resumed_from"):
        ds.resume_state(epoch=1, samples_seen=10, batch_size=5, num_workers=1)
    other = ds.resume_state(epoch=2, samples_seen=10, batch_size=5, num_workers=1)
    with pytest.raises(ValueError, match="resumed_from is not a resume state of epoch 1"):
        ds.resume_state(epoch=1, samples_seen=10, batch_size=5, num_workers=1, resumed_from=other)
