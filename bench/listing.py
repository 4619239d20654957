"""What planning a pack of N files costs: time and peak memory of scanning and cutting
into shards (no image is read). Makes N empty files under --dir once (1000 class folders).

    python -m bench.listing --files 1000000
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MEASURE = """
import resource, sys, time
from shardkit.packing.plan import make_plan
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
plan = make_plan(sys.argv[1], "/tmp/unused-dest", max_count=1000)
took = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(len(plan.order), len(plan.names), round(took, 1), before // 1024, peak // 1024)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    args = ap.parse_args()
    root = Path(args.dir) / f"empty-{args.files}"
    if not (root / ".complete").exists():
        for i in range(args.files):
            folder = root / f"class_{i % 1000:04d}"
            if i < 1000:
                folder.mkdir(parents=True, exist_ok=True)
            (folder / f"img_{i:08d}.jpg").touch()
        (root / ".complete").touch()
    out = subprocess.run([sys.executable, "-c", MEASURE, str(root)], capture_output=True, text=True, check=True).stdout
    files, jobs, took, base, peak = out.split()
    print(
        f"{int(files):,} files, {int(jobs):,} jobs of 1000: planned in {took} s, "
        f"peak RSS {peak} MB ({int(peak) - int(base)} MB above the interpreter with shardkit imported)"
    )


if __name__ == "__main__":
    main()
