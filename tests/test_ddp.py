"""Real DDP: two processes in a gloo process group; each rank learns its rank from
torch.distributed (no rank arguments) and every rank yields the same number of batches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader

from conftest import run_ranks
from servers import free_port

WORLD = 2
# pass 2, without set_epoch, must advance the epoch on every rank alike; pass 3 runs spawned
# workers, which have no process group: they rely on the rank the dataset pinned when pickled
PASSES = 3


def _rank_main(rank: int, port: int, dataset: str, out: str) -> None:
    from shardkit.reading.dataset import StreamingDataset

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ds = StreamingDataset(dataset, shuffle=True, seed=11)  # rank and world size from the process group
        loader = DataLoader(ds, num_workers=2, batch_size=8)
        spawned = DataLoader(ds, num_workers=1, batch_size=8, multiprocessing_context="spawn")
        mine = {"len": len(ds), "passes": []}
        for p in range(PASSES):
            if p == 2:
                loader = spawned
            batches, keys = 0, []
            for batch in loader:
                batches += 1
                keys += batch["__key__"]
            mine["passes"].append({"batches": batches, "keys": keys})
        everyone: list = [None] * WORLD
        dist.all_gather_object(everyone, mine)
        Path(out, f"rank{rank}.json").write_text(json.dumps(everyone))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_from_process_group_split_the_epoch(packed: Path, tmp_path: Path) -> None:
    run_ranks(_rank_main, (free_port(), str(packed), str(tmp_path)), WORLD)
    gathered = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert gathered[0] == gathered[1]  # all_gather_object gave both ranks the same view
    ranks = gathered[0]
    assert [r["len"] for r in ranks] == [60, 60]  # len() saw world size 2 from torch.distributed
    everything = {f"{i:06d}" for i in range(120)}
    orders = []
    for p in range(PASSES):
        per_rank = [r["passes"][p] for r in ranks]
        # 2 workers x 30 samples: 4 batches each; 1 worker x 60: 7 of 8 and one of 4
        assert per_rank[0]["batches"] == per_rank[1]["batches"] == 8
        assert [len(r["keys"]) for r in per_rank] == [60, 60]
        assert all(len(set(r["keys"])) == 60 for r in per_rank)
        assert set(per_rank[0]["keys"]) | set(per_rank[1]["keys"]) == everything
        orders.append(per_rank[0]["keys"])
    assert orders[0] != orders[1] != orders[2]  # the epoch advanced between passes
