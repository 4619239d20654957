"""One rank of the multi-node test (tests/test_multinode.py), started by torchrun.

    worker.py DATASET OUT_DIR PHASE[+PHASE...] [STATE_FILE]

phase "full":  iterate one epoch, record every key and the batch count.
phase "part":  take BATCHES batches, then record them and this rank's resume state.
phase "rest":  load the saved state (taken under another world size) and record the rest.
Phases joined by "+" run one after another in one launch, each on a dataset of its own:
the launch and the process group (seconds of torch start-up on every rank) are shared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader

from shardkit import StreamingDataset

BATCH, WORKERS, EPOCH, BATCHES = 4, 2, 3, 3


def run(dataset: str, out: Path, phase: str, rank: int, world: int) -> None:
    ds = StreamingDataset(dataset, shuffle=True, seed=7)  # rank and world from torch.distributed
    ds.set_epoch(EPOCH)
    if phase == "rest":
        ds.load_state_dict(json.loads(Path(sys.argv[4]).read_text()))
    keys, batches = [], 0
    for batch in DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=list):
        if phase == "part" and batches == BATCHES:
            break
        keys += [s["__key__"] for s in batch]
        batches += 1
    record = {"rank": rank, "world": world, "len": len(ds), "keys": keys, "batches": batches}
    if phase == "part":
        record["state"] = ds.resume_state(epoch=EPOCH, samples_seen=len(keys), batch_size=BATCH, num_workers=WORKERS)
    (out / f"{phase}-{rank}.json").write_text(json.dumps(record))


def main() -> None:
    dataset, out, phases = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split("+")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for phase in phases:
        run(dataset, out, phase, rank, world)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
