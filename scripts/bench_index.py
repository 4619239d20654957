"""What a large index costs a reader: time to build StreamingDataset from index.json, the
memory it leaves behind and the size of its pickle (what each spawned worker receives).
Writes a generated index.json of --samples samples in --shards shards under --dir once (no
shard is read: building the dataset reads the index only). Each measurement runs in a
fresh process.

    python scripts/bench_index.py --samples 14000000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MEASURE = """
import gc, os, pickle, resource, sys, time
import torch  # imported before the baseline, as in a training script
from shardkit import StreamingDataset
from shardkit.tools.bench import rss

before = rss(os.getpid())
start = time.perf_counter()
ds = StreamingDataset(sys.argv[1], shuffle=True)
took = time.perf_counter() - start
gc.collect()
kept = rss(os.getpid()) - before
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
print(len(ds), took, kept, peak, len(pickle.dumps(ds)))
"""


def write_index(folder: Path, samples: int, shards: int) -> None:
    per = samples // shards
    folder.mkdir(parents=True, exist_ok=True)
    entries = [{"name": f"shard-{i:06d}.tar", "samples": per, "bytes": per * 110_000 + 1024, "sha256": f"{i:064x}",
                "offsets": list(range(0, (per + 1) * 110_000, 110_000))} for i in range(shards)]
    doc = {"format": "shardkit", "version": 1, "kind": "tar", "samples": per * shards,
           "bytes": sum(e["bytes"] for e in entries), "fields": ["cls", "jpg"],
           "classes": [f"class_{i:04d}" for i in range(1000)], "plan": None, "skipped": [], "shards": entries}
    (folder / "index.json").write_text(json.dumps(doc, separators=(",", ":")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=14_000_000)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    args = ap.parse_args()
    folder = Path(args.dir) / f"index-{args.samples}"
    if not (folder / "index.json").exists():
        write_index(folder, args.samples, args.shards)
    size = (folder / "index.json").stat().st_size
    runs = []
    for _ in range(args.rounds):
        out = subprocess.run([sys.executable, "-c", MEASURE, str(folder)], capture_output=True, text=True, check=True)
        runs.append([float(x) for x in out.stdout.split()])
    runs.sort(key=lambda r: r[1])
    n, took, kept, peak, pickled = runs[len(runs) // 2]  # the median build time's run
    print("| samples | index.json MB | build s | memory kept MB | peak during build MB | pickle MB |")
    print("|---|---|---|---|---|---|")
    print(f"| {int(n):,} | {size / 1e6:,.0f} | {took:.2f} | {kept / 1e6:,.0f} | {peak / 1e6:,.0f} | {pickled / 1e6:,.0f} |")


if __name__ == "__main__":
    main()
