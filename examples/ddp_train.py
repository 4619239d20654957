"""Data-parallel training on CPU: DistributedDataParallel over gloo, fed by StreamingDataset.

    torchrun --nproc_per_node 2 examples/ddp_train.py ./photos-shards --epochs 2
    python examples/ddp_train.py ./photos-shards --spawn 2      # where torchrun is not at hand

Each rank learns its rank and world size from torch.distributed (nothing is passed to the
dataset), reads its own share of every epoch through a DataLoader with workers, and yields
exactly len(ds) samples: every rank runs the same number of steps, so DDP's gradient
all-reduce never waits for a rank that ran out of data. Rank 0 prints the batches each rank
took (always equal) and the throughput of all ranks together. The model and the per-sample
transform (any image format) are those of train_local.py.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

# train_local.py lives beside this file: importable whatever the working directory, under
# torchrun, python, and in the processes --spawn starts (which re-run this module's top level).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_local import model, to_training_pair  # noqa: E402

from shardkit import StreamingDataset  # noqa: E402


def train(args: argparse.Namespace) -> None:
    """One rank's training loop; the process group is already up."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the machine's cores
    torch.manual_seed(0)
    ds = StreamingDataset(
        args.shards,
        shuffle=True,
        seed=0,
        decode="tensor",
        transform=functools.partial(to_training_pair, label=args.label),
        batch_size=args.batch_size,
    )  # batches made in the workers: batch_size=None below
    # A process started by mp.spawn starts its own children by spawn too: every DataLoader worker
    # would import torch and this script again (seconds each). Fork them, as under torchrun.
    fork = args.workers > 0 and "fork" in multiprocessing.get_all_start_methods()
    loader = DataLoader(
        ds,
        batch_size=None,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        multiprocessing_context="fork" if fork else None,
    )
    net = DistributedDataParallel(model(len(ds.classes) or 1000))  # broadcasts rank 0's weights
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    if rank == 0:
        print(
            f"{world} ranks x {args.workers} workers: {len(ds)} batches per rank per epoch, {len(ds.classes)} classes",
            flush=True,
        )
    for epoch in range(args.epochs):
        ds.set_epoch(epoch)  # the same order on every rank; each takes its own share of it
        dist.barrier()
        start = time.perf_counter()
        batches = samples = 0
        loss_sum = 0.0
        for images, labels in loader:
            loss = F.cross_entropy(net(images), labels)
            opt.zero_grad()
            loss.backward()  # all-reduces the gradients: every rank must take this step
            opt.step()
            batches += 1
            samples += len(labels)
            loss_sum += loss.item() * len(labels)
        mine = torch.tensor([batches, samples, loss_sum, time.perf_counter() - start], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        if rank == 0:
            per_rank = [int(t[0]) for t in everyone]
            total = sum(int(t[1]) for t in everyone)
            took = max(float(t[3]) for t in everyone)
            loss_avg = sum(float(t[2]) for t in everyone) / max(total, 1)
            print(
                f"epoch {epoch}: batches per rank {per_rank}, samples per rank {[int(t[1]) for t in everyone]}; "
                f"{total} samples in {took:.2f} s = {total / took:.0f} samples/s, loss {loss_avg:.3f}",
                flush=True,
            )
            if len(set(per_rank)) != 1:
                raise RuntimeError(f"ranks took different numbers of batches: {per_rank}")


def _run(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", help="a dataset folder written by `shardkit pack` (or a URL)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--label", default="cls", help="the field holding each sample's class number")
    ap.add_argument(
        "--spawn",
        type=int,
        metavar="N",
        help="start N ranks here (torch.multiprocessing.spawn) instead of being started by torchrun",
    )
    args = ap.parse_args()

    if args.spawn:
        init = f"tcp://127.0.0.1:{_free_port()}"
        mp.spawn(_run, args=(args.spawn, init, args), nprocs=args.spawn, join=True)
    elif "RANK" in os.environ:  # started by torchrun: rank, world size and rendezvous from the environment
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
    else:
        print("not started by torchrun and no --spawn N: running a single rank", flush=True)
        _run(0, 1, f"tcp://127.0.0.1:{_free_port()}", args)


if __name__ == "__main__":
    main()
