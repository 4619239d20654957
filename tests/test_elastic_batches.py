"""Real DDP (gloo process groups) under global_batch_size: a run preempted at random points
and resumed under other world sizes and num_workers, 4x2 -> 2x3 -> 8x1 -> 3x2, hands over
exactly the global batches of an uninterrupted 1x1 run, in order. The checkpoints alternate
between StatefulDataLoader's state and a plain DataLoader's `resume_state`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader

from conftest import make_folder, run_ranks
from servers import free_port

pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]
B = 24
OPTIONS: dict[str, Any] = {"shuffle": True, "seed": 9, "global_batch_size": B, "block": 4, "shuffle_window": 48}
STAGES = [(4, 2), (2, 3), (8, 1), (3, 2), (2, 1)]  # (world size, num_workers); the last one reads to the end


@pytest.fixture(scope="module")
def larger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 samples in shards of 16: 13 global batches of 24."""
    import shardkit

    root = tmp_path_factory.mktemp("elastic")
    shardkit.pack(
        str(make_folder(root / "photos", per_class=100)), str(root / "shards"), max_count=16, workers=1, progress=False
    )
    return root / "shards"


def _rank_main(
    rank: int,
    world: int,
    port: int,
    dataset: str,
    workers: int,
    stop: int | None,
    stateful: bool,
    resumed_from: Any,
    out: str,
) -> None:
    from shardkit import StreamingDataset

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ds = StreamingDataset(dataset, **OPTIONS)  # rank and world size from the process group
        if resumed_from is not None:
            ds.load_state_dict(resumed_from)
        b = ds.local_batch_size
        loader: Any
        if stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            loader = StatefulDataLoader(ds, batch_size=b, num_workers=workers, snapshot_every_n_steps=1)
        else:
            loader = DataLoader(ds, batch_size=b, num_workers=workers)
        it = iter(loader)
        keys = []
        for batch in it:
            keys.append(list(batch["__key__"]))
            if len(keys) == stop:
                break
        if stateful:
            saved = loader.state_dict()
        else:
            saved = ds.resume_state(
                epoch=0, samples_seen=len(keys) * b, num_workers=workers, batch_size=b, resumed_from=resumed_from
            )
        del it
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, {"keys": keys, "len": len(ds), "state": json.dumps(saved, sort_keys=True)})
        if rank == 0:
            Path(out).write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_preempted_four_times_under_new_layouts_the_batches_of_one_rank(larger: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchdata.stateful_dataloader")
    from shardkit import StreamingDataset
    from shardkit.reading import state

    ds = StreamingDataset(str(larger), **OPTIONS)
    whole = [list(batch["__key__"]) for batch in DataLoader(ds, batch_size=B)]
    assert len(whole) == 13
    rng = np.random.default_rng(20261202)
    cuts = sorted(rng.choice(np.arange(1, len(whole)), len(STAGES) - 1, replace=False).tolist())
    stops = [b - a for a, b in zip([0, *cuts], cuts)] + [None]
    got: list[list[str]] = []
    resumed_from = None
    for i, ((world, workers), stop) in enumerate(zip(STAGES, stops)):
        out = tmp_path / f"stage{i}.json"
        stateful = i % 2 == 0
        run_ranks(_rank_main, (world, free_port(), str(larger), workers, stop, stateful, resumed_from, str(out)), world)
        ranks = json.loads(out.read_text())
        # the same but for the fingerprints, each its own rank's
        ours = [
            sorted(
                str({k: v for k, v in s.items() if k not in (state.DIGEST, state.WORKERS)})
                for s in state.find_states(json.loads(r["state"]))
            )
            for r in ranks
        ]
        assert all(o == ours[0] for o in ours)  # ranks step in lockstep: one state describes all
        assert {r["len"] for r in ranks} == {len(whole) * B // world}
        slices = [r["keys"] for r in ranks]
        assert len({len(s) for s in slices}) == 1
        got += [sum(parts, []) for parts in zip(*slices)]
        resumed_from = json.loads(ranks[0]["state"])
        assert got == whole[: len(got)], f"stage {i} ({world}x{workers}) after cuts {cuts}"
    assert got == whole
