"""Where a worker's CPU goes when it streams from S3: one epoch of raw samples, read in one
process from moto's S3 server (its own process, not profiled), under py-spy (all threads,
s3fs's event loop included). Prints the CPU seconds per package, per request and per MB.

    pip install py-spy   # or --py-spy PATH
    python -m bench.profile_remote /tmp/shards --prefetch 8
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time
from pathlib import Path

from bench.s3 import BUCKET, options, proxy_command, start_moto, start_proxy

RATE = 200  # py-spy samples a second
PACKAGES = (
    "shardkit",
    "s3fs",
    "aiobotocore",
    "botocore",
    "aiohttp",
    "asyncio",
    "fsspec",
    "urllib3",
    "threading",
    "concurrent",
    "selectors",
    "ssl",
    "json",
    "xml",
    "hashlib",
    "numpy",
)


def one_epoch(url: str, endpoint: str, prefetch: int) -> None:
    from shardkit import StreamingDataset

    ds = StreamingDataset(url, storage_options=options(endpoint), prefetch=prefetch, shuffle=True)
    n = sum(1 for _ in ds)
    print(f"{n} samples", file=sys.stderr)


# leaf frames that wait (py-spy shows a wait in C as the Python frame that called it): the
# read-ahead threads' queue, thread pools, conditions, the event loop's select; "" is a thread
# with no Python frame
IDLE = (
    "Condition.wait",
    "Event.wait",
    "EpollSelector.select",
    "SimpleQueue.get",
    "_worker (concurrent",
    "sleep",
    "Thread._wait_for_tstate_lock",
    "_Threads._work",
)


def package_of(frame: str) -> str:
    """py-spy's frame 'function (path/to/module.py:line)' -> the top package's name."""
    path = frame.rsplit("(", 1)[-1]
    for name in PACKAGES:
        if path.startswith((f"{name}/", f"{name}.py")) or f"/{name}/" in path or f"/{name}.py" in path:
            return name
    return "other"


def report(raw: Path, requests: int, mb: float, rate: int) -> None:
    """CPU per package (self time), leaving out imports and waits, per request and per MB."""
    self_time: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if any("importlib" in f for f in frames) or not frames[-1] or frames[-1].startswith(IDLE):
            continue
        self_time[package_of(frames[-1])] += int(count)
        leaf[frames[-1]] += int(count)
    total = sum(self_time.values())
    cpu = total / rate
    print(
        f"\n{requests} requests, {mb:.0f} MB; {cpu:.2f} CPU s sampled in the epoch (all threads; imports and waits "
        f"left out): {1000 * cpu / max(requests, 1):.1f} ms a request, {1000 * cpu / max(mb, 1):.2f} ms a MB\n"
    )
    for name, n in self_time.most_common(14):
        print(f"{100 * n / total:5.1f}%  {name}")
    print()
    for frame, n in leaf.most_common(20):
        print(f"{100 * n / total:5.1f}%  {frame[:150]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shards", help="a packed dataset folder")
    ap.add_argument("--prefetch", type=int, default=8)
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--out", default="/tmp/profile_remote.txt")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        url, endpoint = args.stage.split(",")
        return one_epoch(url, endpoint, args.prefetch)
    import fsspec.core

    moto, endpoint = start_moto()
    proxy, purl, control = start_proxy(endpoint, 0)
    try:
        fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}", **options(endpoint))
        fs.mkdir(BUCKET)
        fs.put(args.shards, f"{BUCKET}/ds", recursive=True)
        before = proxy_command(control, "stats")
        t0 = time.perf_counter()
        subprocess.run(
            [
                args.py_spy,
                "record",
                "--format",
                "raw",
                "--rate",
                str(RATE),
                "--output",
                args.out,
                "--",
                sys.executable,
                "-m",
                "bench.profile_remote",
                args.shards,
                "--prefetch",
                str(args.prefetch),
                "--stage",
                f"s3://{BUCKET}/ds,{purl}",
            ],
            check=True,
        )
        took = time.perf_counter() - t0
        after = proxy_command(control, "stats")
    finally:
        for p in (proxy, moto):
            p.stop()
    import json

    b, a = json.loads(before), json.loads(after)
    print(f"{took:.1f} s wall, py-spy's overhead included")
    report(Path(args.out), a["requests"] - b["requests"], (a["bytes"] - b["bytes"]) / 1e6, RATE)


if __name__ == "__main__":
    main()
