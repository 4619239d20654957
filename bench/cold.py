"""Random access on a cold page cache: LMDBDataset against the plain files.

The warm-cache numbers (bench/read.py) leave storage out: every byte is in memory. Here the
page cache is emptied of the dataset before each contestant (`sync`, then
posix_fadvise(DONTNEED) on every file: no root needed), and each reads the same random
`--samples` of the same images through DataLoader(num_workers=2, batch_size=64), raw (the
bytes only) and decoded (the same decode + resize to 224 as bench/read.py); the streaming
rows read the first `--samples` of a shuffled epoch instead. Contestants interleaved,
medians with min-max, ratios against the plain files.

    python -m bench.cold --samples 3000 --rounds 3      # after bench/read.py made the data
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

import shardkit
from bench.readers import BATCH, WORKERS, Files, ranged, shardkit_transform
from shardkit.bench.harness import markdown_table, median

STREAM = "StreamingDataset over the LMDB"  # shuffled: the first --samples of an epoch
STREAM_SERIAL = "StreamingDataset over the LMDB, prefetch=0"
CONTESTANTS = {  # name -> LMDBDataset or StreamingDataset options, or None for the plain files
    "LMDBDataset (default: 16 read threads a worker)": {},
    "LMDBDataset, read_threads=1": {"read_threads": 1},
    "LMDBDataset, readahead=True": {"readahead": True},
    STREAM: {},
    STREAM_SERIAL: {"prefetch": 0},
    "plain files (ImageFolder-like)": None,
}


class RawFiles(Files):
    def __getitem__(self, i: int) -> int:
        with open(self.items[i][0], "rb") as f:
            return len(f.read())


def raw_length(sample: dict) -> int:
    return len(sample["jpg"])


def evict(paths: list[Path]) -> None:
    subprocess.run(["sync"], check=True)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(name: str, decoded: bool, photos: Path, lmdb: Path, picks: list[int], seed: int) -> float:
    options = CONTESTANTS[name]
    transform = shardkit_transform if decoded else raw_length
    if options is None:
        loader = DataLoader(
            Files(str(photos)) if decoded else RawFiles(str(photos)),
            batch_size=BATCH,
            sampler=picks,
            num_workers=WORKERS,
        )
    elif name in (STREAM, STREAM_SERIAL):
        ds = shardkit.StreamingDataset(str(lmdb), shuffle=True, seed=seed, transform=transform, **options)
        loader = DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    else:
        loader = DataLoader(
            shardkit.LMDBDataset(str(lmdb), transform=transform, **options),
            batch_size=BATCH,
            sampler=picks,
            num_workers=WORKERS,
        )
    start = time.perf_counter()
    n = 0
    for batch in loader:
        n += len(batch[0]) if isinstance(batch, (list, tuple)) else len(batch)
        if n >= len(picks):
            break
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=20000, help="which bench/read.py data set")
    ap.add_argument("--samples", type=int, default=3000, help="random samples read per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    args = ap.parse_args()
    root = Path(args.dir)
    photos, lmdb = root / f"photos-{args.images}", root / f"shards-{args.images}.lmdb"
    if not (lmdb / "data.mdb").exists():
        raise SystemExit(f"{lmdb}: run python -m bench.read --images {args.images} first (it makes the data)")
    files = sorted(photos.rglob("*.jpg")) + [lmdb / "data.mdb"]
    results: dict[tuple[str, bool], list[float]] = {}
    for r in range(args.rounds):
        picks = np.random.default_rng(r).permutation(args.images)[: args.samples].tolist()
        for decoded in (False, True):
            for name in CONTESTANTS:
                evict(files)
                results.setdefault((name, decoded), []).append(measure(name, decoded, photos, lmdb, picks, r))
                print(f"round {r + 1}: {'decoded' if decoded else 'raw'} {name} done", file=sys.stderr)
    base = {d: median(results[("plain files (ImageFolder-like)", d)]) for d in (False, True)}
    head = f"cold page cache, {args.samples} random samples, DataLoader(num_workers={WORKERS})"
    rows = []
    for name in CONTESTANTS:
        cells = [name]
        for decoded in (False, True):
            values = results[(name, decoded)]
            cells += [ranged(values), f"{median(values) / base[decoded]:.2f}x"]
        rows.append(cells)
    print(markdown_table([head, "raw samples/s", "vs plain files", "decoded images/s", "vs plain files"], rows))


if __name__ == "__main__":
    main()
