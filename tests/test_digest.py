"""The consumed-set fingerprint in every state dict: resumed five times in a row at random
points (StatefulDataLoader's states and a plain DataLoader's `resume_state`, both orders),
and refused, naming the positions, when a state is edited or stale."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

from shardkit import StreamingDataset
from shardkit.order import digest
from shardkit.reading import state

from readers import WARNINGS
from resume import check_save_load, into_dataset, loader_state, resume_state

pytestmark = WARNINGS
StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
MODES = {
    "default": {"shuffle_window": 16, "block": 4},
    "global": {"global_batch_size": 6, "block": 4, "shuffle_window": 24},
}


def test_the_fingerprint_of_spans_is_that_of_their_positions() -> None:
    rng = np.random.default_rng(1)
    for _ in range(100):
        starts = rng.integers(0, 2**40, rng.integers(1, 8))
        stops = starts + rng.integers(0, 40, len(starts))
        positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, stops)])
        assert digest.of_spans(starts, stops) == digest.of_positions(positions)
    one = digest.of_spans(np.array([0]), np.array([100]))
    assert digest.parse(digest.text(one)) == one
    assert digest.of_positions(np.r_[0:50, 51:100, 49]) != one  # 50 skipped, 49 twice


def dataset(packed: Path, mode: str, **options: Any) -> StreamingDataset:
    return StreamingDataset(str(packed), shuffle=True, seed=8, **{**MODES[mode], **options})


def stops(seed: int, n: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(1, 4, n).tolist()


@pytest.mark.parametrize("mode", list(MODES))
def test_five_stateful_resumes_in_a_row_under_new_layouts(packed: Path, mode: str) -> None:
    b = 6 if mode == "global" else 4
    layouts = [2, 1, 3, 0, 2, 1]  # num_workers of each build

    def build(workers: int) -> Any:
        return lambda: StatefulDataLoader(dataset(packed, mode), batch_size=b, num_workers=workers)

    resumed = check_save_load(
        [build(w) for w in layouts], stops(3), save=loader_state, load=into_dataset, same_order=mode == "global"
    )  # global batches: the very order of one pass
    for saved in resumed.states:
        found = [s for s in state.find_states(saved) if state.is_worker(s)]
        assert found and all(isinstance(s[state.DIGEST]["sums"], str) for s in found)


@pytest.mark.parametrize("mode", list(MODES))
def test_five_plain_resumes_in_a_row_under_new_layouts(packed: Path, mode: str) -> None:
    b = 6 if mode == "global" else 4
    layouts = [1, 3, 2, 0, 1, 2]

    def build(workers: int) -> Any:
        return lambda: DataLoader(dataset(packed, mode), batch_size=b, num_workers=workers)

    resumed = check_save_load(
        [build(w) for w in layouts],
        stops(4),
        save=resume_state(epoch=0),
        load=into_dataset,
        same_order=mode == "global",
    )
    last = resumed.states[-1]
    assert len(last[state.HISTORY]) == 4 and all(state.DIGEST in h for h in last[state.HISTORY])  # and its own
    assert all(state.DIGEST in w for w in last[state.WORKERS])


def stateful_states(packed: Path, mode: str, stops: list[int]) -> list[dict[str, Any]]:
    """StatefulDataLoader states of one pass after each count of batches in `stops`."""
    loader = StatefulDataLoader(dataset(packed, mode), batch_size=6 if mode == "global" else 4, num_workers=2)
    it, taken, out = iter(loader), 0, []
    for stop in stops:
        while taken < stop:
            next(it)
            taken += 1
        out.append(copy.deepcopy(loader.state_dict()))
    return out


def worker_states(saved: dict[str, Any]) -> list[dict[str, Any]]:
    snaps = saved["_snapshot"]["_worker_snapshots"]
    return [snaps[f"worker_{w}"]["fetcher_state"]["dataset_iter_state"] for w in range(len(snaps))]


@pytest.mark.parametrize("mode", list(MODES))
def test_an_edited_count_is_refused_naming_the_positions(packed: Path, mode: str) -> None:
    (saved,) = stateful_states(packed, mode, [3])
    worker_states(saved)[1][state.YIELDED] += 2
    with pytest.raises(
        ValueError,
        match=r"epoch 0, positions \d+\.\.\d+: worker 1 of rank 0 says it delivered \d+ "
        r"samples, not the ones its fingerprint records",
    ):
        dataset(packed, mode).load_state_dict(saved)
    plain = dataset(packed, mode).resume_state(epoch=0, samples_seen=12, num_workers=2, batch_size=6)
    plain[state.WORKERS][0][state.YIELDED] = 0
    with pytest.raises(ValueError, match="says it delivered 0 samples"):
        dataset(packed, mode).load_state_dict(plain)


def test_an_edited_history_is_refused(packed: Path) -> None:
    first = dataset(packed, "default").resume_state(epoch=0, samples_seen=8, num_workers=2, batch_size=4)
    ds = dataset(packed, "default")
    ds.load_state_dict(first)
    second = ds.resume_state(epoch=0, samples_seen=8, num_workers=1, batch_size=4, resumed_from=first)
    assert digest.parse(second[state.HISTORY][0][state.DIGEST]) != digest.ZERO
    edited = json.loads(json.dumps(second))
    edited[state.HISTORY][0]["yielded"] = [4, 0]
    with pytest.raises(
        ValueError,
        match=r"epoch 0, positions \d+\.\.\d+: this state's segment 0 \(1 ranks x 2 "
        r"workers, counts \[4, 0\]\) is not the one its fingerprint was made from",
    ):
        dataset(packed, "default").load_state_dict(edited)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_stale_worker_snapshot_is_refused(packed: Path, mode: str) -> None:
    older, newer = stateful_states(packed, mode, [2, 5])
    mixed = copy.deepcopy(newer)
    mixed["_snapshot"]["_worker_snapshots"]["worker_1"] = older["_snapshot"]["_worker_snapshots"]["worker_1"]
    with pytest.raises(
        ValueError,
        match=r"this StatefulDataLoader state is at its batch 5, but its snapshot of "
        r"worker 1 counts \d+ samples, not \d+ \(a stale or mixed-up state\)",
    ):
        dataset(packed, mode).load_state_dict(mixed)
    dataset(packed, mode).load_state_dict(newer)  # the state as saved is fine


def test_a_stale_resumed_from_is_refused(packed: Path) -> None:
    ds = dataset(packed, "global")
    first = ds.resume_state(epoch=0, samples_seen=6, num_workers=1, batch_size=6)
    second = ds.resume_state(epoch=0, samples_seen=18, num_workers=1, batch_size=6)
    ds.load_state_dict(second)
    with pytest.raises(ValueError, match="resumed_from is not the state this dataset resumed epoch 0 from"):
        ds.resume_state(epoch=0, samples_seen=6, num_workers=2, batch_size=6, resumed_from=first)


def test_the_end_of_a_pass_checks_what_it_delivered(packed: Path) -> None:
    it = iter(dataset(packed, "default"))
    next(it)
    piece = it.stream._pieces[0][1]  # what the pass records it delivered: one sample twice, one never
    piece[1] = piece[0]
    with pytest.raises(
        RuntimeError,
        match=r"epoch 0, positions 0\.\.119: worker 0 of rank 0 delivered 120 samples "
        r"that are not its share of the epoch \(120\)",
    ):
        for _ in it:
            pass


@pytest.mark.parametrize("global_batch", [None, 6])
def test_a_mixture_resumed_five_times(packed: Path, global_batch: int | None) -> None:
    def build(workers: int) -> Any:
        def make() -> DataLoader:
            mix = StreamingDataset.mix(
                [(str(packed), 1.0), (str(packed), 3.0)],
                shuffle=True,
                seed=3,
                samples_per_epoch=90,
                block=4,
                global_batch_size=global_batch,
            )
            return DataLoader(mix, batch_size=6, num_workers=workers)

        return make

    keys = lambda batch: [f"{k}@{u.rsplit('/', 1)[-1]}" for k, u in zip(batch["__key__"], batch["__url__"])]  # noqa: E731
    resumed = check_save_load(
        [build(w) for w in (2, 1, 3, 0, 2, 1)],
        stops(5),
        save=resume_state(epoch=0),
        load=into_dataset,
        keys=keys,
        same_order=global_batch is not None,
    )
    assert all(state.DIGEST in h for h in resumed.states[-1][state.HISTORY])


@pytest.mark.parametrize("mode", list(MODES))
def test_the_loaders_own_resume_five_times_and_an_edited_worker_state(packed: Path, mode: str) -> None:
    """StatefulDataLoader's own load_state_dict, same layout: each worker checks its state."""
    b = 6 if mode == "global" else 4

    def build() -> Any:
        return StatefulDataLoader(dataset(packed, mode), batch_size=b, num_workers=2)

    resumed = check_save_load(build, stops(6), same_order=True)
    edited = copy.deepcopy(resumed.states[2])
    worker_states(edited)[0][state.YIELDED] += b
    loader = build()
    loader.load_state_dict(edited)
    with pytest.raises(
        ValueError,
        match=r"worker 0 of rank 0 says it delivered \d+ samples, not the ones its "
        r"fingerprint records",
    ):
        list(loader)
