"""Which client reads gs:// shards: gcsfs (the default) against obstore (`storage_options={"client":
"obstore"}`), on fake-gcs-server behind tests/servers/latency_proxy.py at 0 and +100 ms.

Each epoch a fresh process: DataLoader(num_workers=2, batch_size=64), raw bytes, shuffled, the
index pinned to the objects' generations; the clients interleaved (their order alternates each
round). Per epoch: samples/s, every sample once, the client's CPU seconds (the process and its
DataLoader workers, from the first batch asked to the last) and per GB through the proxy.
Prints a markdown table of medians (min-max) over rounds, and obstore's rate over gcsfs's in the
same round.

    python -m bench.gcs --images 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read by gcsfs at import
from bench.s3 import proxy_command, start_fakegcs, start_proxy, stop  # noqa: E402
from shardkit.bench.harness import spread  # noqa: E402

BUCKET = "bench"
CLIENTS = ("gcsfs", "obstore")
CONDITIONS = {"0 ms": 0, "+100 ms": 100}

EPOCH = """
import json, resource, sys, time
from torch.utils.data import DataLoader
from shardkit import StreamingDataset

def cpu():
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))

opts = json.loads(sys.argv[2])
ds = StreamingDataset(sys.argv[1], storage_options=opts, shuffle=True)
loader = DataLoader(ds, batch_size=64, num_workers=2)
c0, t0 = cpu(), time.perf_counter()
keys = [k for batch in loader for k in batch["__key__"]]
took = time.perf_counter() - t0
del loader  # its workers joined: their CPU is in RUSAGE_CHILDREN
print(json.dumps({"seconds": took, "cpu_s": cpu() - c0, "samples": len(keys), "unique": len(set(keys)),
                  "store": ds.stats()["store"]}))
"""


def options(endpoint: str) -> dict:
    return {"token": "anon", "project": "test", "endpoint_url": endpoint}


def epoch(url: str, opts: dict, timeout: float) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", EPOCH, url, json.dumps(opts)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ,
    )
    if done.returncode:
        raise SystemExit(f"epoch failed ({opts.get('client')}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one epoch may take")
    args = ap.parse_args()

    import fsspec

    import shardkit
    from scripts.make_images import make_image_folder
    from shardkit import index

    root = Path(args.dir)
    photos, shards = root / f"photos-{args.images}", root / f"remote-shards-{args.images}-24MB"
    make_image_folder(photos, args.images, n_classes=100, seed=0)
    if not (shards / "index.json").exists():
        shutil.rmtree(shards, ignore_errors=True)
        shardkit.pack(str(photos), str(shards), max_size="24MB", progress=False)
    server, endpoint = start_fakegcs(root)
    procs = [server]
    try:
        urllib.request.urlopen(
            urllib.request.Request(
                f"{endpoint}/storage/v1/b?project=test",
                data=json.dumps({"name": BUCKET}).encode(),
                headers={"Content-Type": "application/json"},
                method="POST",
            ),
            timeout=10,
        ).read()
        url, opts = f"gs://{BUCKET}/ds", options(endpoint)
        fs, path = fsspec.core.url_to_fs(url, **opts)
        fs.put(str(shards), path, recursive=True)
        index.save(index.pinned(index.load(url, opts), url, opts), url, opts)
        proxies = {}
        for label, ms in CONDITIONS.items():
            proc, purl, control = start_proxy(endpoint, ms)
            procs.append(proc)
            proxies[label] = (purl, control)
        for client in CLIENTS:  # an untimed warm-up: bytecode compiled, shards in the server's memory
            epoch(url, {**opts, "client": client}, args.timeout)
        runs: dict[tuple[str, str], list[dict]] = {}
        for r in range(args.rounds):
            for label, (purl, control) in proxies.items():
                for client in CLIENTS if r % 2 == 0 else CLIENTS[::-1]:
                    before = json.loads(proxy_command(control, "stats"))["bytes"]
                    got = epoch(url, {**options(purl), "client": client}, args.timeout)
                    got["gb"] = (json.loads(proxy_command(control, "stats"))["bytes"] - before) / 1e9
                    assert got["samples"] == got["unique"] == args.images, got
                    runs.setdefault((label, client), []).append(got)
                    print(
                        f"round {r + 1} {label} {client}: {args.images / got['seconds']:,.0f} samples/s, "
                        f"{got['cpu_s']:.2f} CPU s, {got['gb'] * 1e3:.0f} MB, {got['store']}",
                        flush=True,
                    )
        report(runs, args)
    finally:
        for proc in procs:
            stop(proc)


def report(runs: dict[tuple[str, str], list[dict]], args: argparse.Namespace) -> None:
    def cell(values: list[float], digits: int) -> str:
        return spread(values, digits)

    print(
        f"\n{args.images:,} images, {args.rounds} interleaved rounds, fake-gcs-server behind "
        "tests/servers/latency_proxy.py; median (min-max) over rounds\n"
    )
    print(
        "| client | "
        + " | ".join(f"samples/s, {c}" for c in CONDITIONS)
        + " | "
        + " | ".join(f"CPU s / GB, {c}" for c in CONDITIONS)
        + " |"
    )
    print("|---" * (1 + 2 * len(CONDITIONS)) + "|")
    for client in CLIENTS:
        rates = [cell([args.images / g["seconds"] for g in runs[(c, client)]], 0) for c in CONDITIONS]
        cpus = [cell([g["cpu_s"] / g["gb"] for g in runs[(c, client)]], 2) for c in CONDITIONS]
        print(f"| {client} | " + " | ".join(rates + cpus) + " |")
    ratios = [
        cell([b["seconds"] / a["seconds"] for a, b in zip(runs[(c, "obstore")], runs[(c, "gcsfs")])], 2)
        for c in CONDITIONS
    ]
    print("| obstore / gcsfs, same round | " + " | ".join(ratios) + " | | |")


if __name__ == "__main__":
    main()
