"""Streaming from an object store: local disk vs a local S3 server (moto, or SeaweedFS with
--server seaweedfs: a figure that moves with the server is the server's) with 0, 50 and
100 ms of added first-byte latency (a delaying TCP proxy on loopback), read-ahead off and
on, in one run, interleaved, medians of several rounds. Then a fault run: 5% of the
proxy's responses are reset mid-way and the epoch must still deliver every sample once.

Raw reading (no decode) in one process: what the storage path can deliver.

    python -m bench.remote --images 2000 --rounds 3
    python -m bench.remote --images 2000 --rounds 3 --server seaweedfs

With --peers: shardkit against webdataset, MosaicML Streaming, litdata and AWS s3torchconnector,
and a ceiling (every shard fetched at once by curl), on the same server, data and loader, under
five conditions of the proxy: 0 ms, +100 ms, 50 ms with 20 MB/s a connection, 20 ms with 5% of
requests at 1 s, 50 ms with 2% of responses reset (bench/remote_peers_run.py says what is
measured). --conditions and --contestants pick a subset (keys or indices, comma-separated).

    python -m bench.remote --peers --images 2000 --rounds 3
    python -m bench.remote --peers --images 300 --rounds 1 --conditions bw,tail --contestants shardkit,ceiling

With --pack: packing from the bucket (to local disk, 2 workers) at 0 and +50 ms, against
packing from local disk: an image folder, a job reading its files REMOTE_READS at a time
as it does and one at a time (REMOTE_READS=1, as before 2026-11-29); a dataset converted.
The requests and bytes that went through the +50 ms proxy are counted.

    python -m bench.remote --pack --images 500 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench.s3 import BUCKET, PREFETCH_ON, SERVERS, bucket_fs, options, proxy_command, start_proxy, start_server, stop
from shardkit.bench.harness import median, spread

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def read_pass(url: str, opts: dict | None, prefetch: int) -> dict:
    """Construct the dataset and read one epoch of raw samples; time both."""
    from shardkit import StreamingDataset

    t0 = time.perf_counter()
    ds = StreamingDataset(url, storage_options=opts, prefetch=prefetch, shuffle=True)
    t1 = time.perf_counter()
    first = None
    n = size = 0
    keys = []
    for sample in ds:
        if first is None:
            first = time.perf_counter() - t1
        n += 1
        size += len(sample["jpg"])
        keys.append(sample["__key__"])
    took = time.perf_counter() - t1
    return {
        "open_s": t1 - t0,
        "first_s": first,
        "seconds": took,
        "samples": n,
        "bytes": size,
        "keys": keys,
        "depth": ds.stats()["prefetch_depth"],
    }


def pack_pass(src: str, dest: Path, opts: dict | None, settings: dict[str, int]) -> float:
    """Seconds to pack `src` into a fresh `dest` with 2 workers, with `settings` of
    shardkit.packing.jobs (REMOTE_READS) for the time."""
    import shardkit
    from shardkit.packing import jobs

    shutil.rmtree(dest, ignore_errors=True)
    before = {name: getattr(jobs, name) for name in settings}
    for name, value in settings.items():  # a pack of one shard (here) runs in this process
        setattr(jobs, name, value)
    try:
        t0 = time.perf_counter()
        shardkit.pack(src, str(dest), workers=2, progress=False, storage_options=opts)
        return time.perf_counter() - t0
    finally:
        for name, value in before.items():
            setattr(jobs, name, value)


def pack_run(args: argparse.Namespace, photos: Path, shards: Path) -> None:
    from shardkit.packing.jobs import REMOTE_READS

    server, endpoint = start_server(args.server, Path(args.dir))
    proxy, purl, control = start_proxy(endpoint, 50)
    try:
        fs = bucket_fs(endpoint)
        fs.put(str(photos), f"{BUCKET}/raw", recursive=True)
        fs.put(str(shards), f"{BUCKET}/ds", recursive=True)
        dest = Path(args.dir) / "packed-from-s3"
        ways = {
            "image folder": (
                f"s3://{BUCKET}/raw",
                (({}, f"{REMOTE_READS} files at once"), ({"REMOTE_READS": 1}, "a file at a time (before)")),
            ),
            "dataset (conversion)": (f"s3://{BUCKET}/ds", (({}, "a download a shard"),)),
        }
        runs: dict[tuple[str, str, str], tuple[str, dict | None, dict[str, int]]] = {
            ("image folder", "local disk", "-"): (str(photos), None, {}),
            ("dataset (conversion)", "local disk", "-"): (str(shards), None, {}),
        }
        for what, (url, variants) in ways.items():
            for where, endpoint_url in (("S3", endpoint), ("S3 +50 ms", purl)):
                for settings, label in variants:
                    runs[(what, where, label)] = (url, options(endpoint_url), settings)
        seconds: dict[tuple[str, str, str], list[float]] = {}
        fetched: dict[tuple[str, str, str], tuple[int, int]] = {}  # through the proxy: requests, bytes
        for r in range(args.rounds):
            for key, (src, opts, settings) in runs.items():
                before = json.loads(proxy_command(control, "stats"))
                seconds.setdefault(key, []).append(pack_pass(src, dest, opts, settings))
                after = json.loads(proxy_command(control, "stats"))
                if after["requests"] > before["requests"]:
                    fetched[key] = (after["requests"] - before["requests"], after["bytes"] - before["bytes"])
            print(f"round {r + 1} done", file=sys.stderr)
        print(
            f"\n{args.images} photos ({sum(p.stat().st_size for p in photos.rglob('*.jpg')) / 1e6:.0f} MB), "
            f"shardkit.pack(..., workers=2) to local disk, S3 on {args.server}, {args.rounds} rounds; "
            "median (min-max)\n"
        )
        print("| source | where | reads | seconds | images/s | requests | MB fetched |")
        print("|---|---|---|---|---|---|---|")
        for key, values in seconds.items():
            requests, size = fetched.get(key, (0, 0))
            traffic = f"{requests} | {size / 1e6:.1f}" if requests else "- | -"
            print(
                f"| {' | '.join(key)} | {spread(values, digits=2)} | {args.images / median(values):,.0f} | {traffic} |"
            )
    finally:
        for p in (proxy, server):
            stop(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    ap.add_argument("--peers", action="store_true", help="shardkit against its peers (see above)")
    ap.add_argument("--pack", action="store_true", help="packing from the bucket (see above)")
    ap.add_argument(
        "--server",
        choices=SERVERS,
        default="moto",
        help="the S3 server on loopback: moto (an emulator for AWS's SDK tests) or seaweedfs (a store "
        "people run), so a figure can be told apart from the server's cost",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="with --peers: every timed epoch's requests as the proxy saw them, a JSON line each, in "
        "bench-out/traces/ROUND-CONDITION-CONTESTANT.jsonl (wall-clock times; the run's 'began' in the JSON)",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds one contestant's epoch may take")
    ap.add_argument(
        "--conditions",
        default="",
        help="with --peers: the proxy conditions to run, comma-separated keys or indices "
        "(default all; bench/remote_peers_run.py CONDITIONS)",
    )
    ap.add_argument(
        "--contestants",
        default="",
        help="with --peers: the contestants to run, comma-separated keys or indices "
        "(default all; bench/remote_peers.py CONTESTANTS)",
    )
    args = ap.parse_args()
    if args.peers:
        from bench import remote_peers_run

        remote_peers_run.check_choices(ap, args)  # before minutes of setup
    elif args.conditions or args.contestants or args.trace:
        ap.error("--conditions, --contestants and --trace go with --peers")

    import shardkit
    from scripts.make_images import make_image_folder

    root = Path(args.dir)
    size = "24MB" if args.peers else "64MB"  # peers: the size the table used, for every format
    photos, shards = root / f"photos-{args.images}", root / f"remote-shards-{args.images}-{size}"
    make_image_folder(photos, args.images, n_classes=100, seed=0)
    if not (shards / "index.json").exists():
        shutil.rmtree(shards, ignore_errors=True)
        shardkit.pack(str(photos), str(shards), max_size=size, progress=False)
    if args.peers:
        return remote_peers_run.main(args, photos, shards)
    if args.pack:
        return pack_run(args, photos, shards)
    server, endpoint = start_server(args.server, root)
    procs = [server]
    try:
        fs = bucket_fs(endpoint)
        fs.put(str(shards), f"{BUCKET}/ds", recursive=True)
        url = f"s3://{BUCKET}/ds"
        proxies = {}
        for ms in (50, 100):
            proc, purl, control = start_proxy(endpoint, ms)
            procs.append(proc)
            proxies[ms] = (purl, control)
        sources = {
            "local disk": (str(shards), None),
            "S3": (url, options(endpoint)),
            "S3 +50 ms": (url, options(proxies[50][0])),
            "S3 +100 ms": (url, options(proxies[100][0])),
        }
        results: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for name, (src, opts) in sources.items():
                for prefetch in (0, PREFETCH_ON):
                    results.setdefault((name, prefetch), []).append(read_pass(src, opts, prefetch))
            print(f"round {r + 1} done", file=sys.stderr)

        def med(name: str, prefetch: int, key: str) -> float:
            return median(x[key] for x in results[(name, prefetch)])

        def mbs(name: str, prefetch: int) -> list[float]:
            return [x["bytes"] / x["seconds"] / 1e6 for x in results[(name, prefetch)]]

        total = sum(p.stat().st_size for p in shards.glob("*.tar"))
        print(
            f"\n{args.images} images, {total / 1e6:.0f} MB in {len(list(shards.glob('*.tar')))} shards, "
            f"S3 on {args.server}, {args.rounds} rounds, one process, raw samples; median (min-max)\n"
        )
        print("| source | read-ahead | MB/s | samples/s | open s | first sample s | depth |")
        print("|---|---|---|---|---|---|---|")
        for name in sources:
            for prefetch in (0, PREFETCH_ON):
                m = mbs(name, prefetch)
                sps = median(x["samples"] / x["seconds"] for x in results[(name, prefetch)])
                label = "off" if prefetch == 0 else f"on ({prefetch} max)"
                print(
                    f"| {name} | {label} | {spread(m)} | {sps:,.0f} | "
                    f"{med(name, prefetch, 'open_s'):.2f} | {med(name, prefetch, 'first_s'):.2f} | "
                    f"{med(name, prefetch, 'depth'):.1f} |"
                )
        s3_on = median(mbs("S3", PREFETCH_ON))
        on100, off100 = median(mbs("S3 +100 ms", PREFETCH_ON)), median(mbs("S3 +100 ms", 0))
        print(
            f"\nat +100 ms with read-ahead: {on100 / s3_on:.0%} of S3 without added latency, "
            f"{on100 / off100:.1f}x read-ahead off"
        )

        # fault run: 5% of responses reset part-way
        purl, control = proxies[50]
        proxy_command(control, "set reset_prob 0.05")
        before = json.loads(proxy_command(control, "stats"))["resets"]
        fault = read_pass(url, options(purl), PREFETCH_ON)
        resets = json.loads(proxy_command(control, "stats"))["resets"] - before
        keys = fault["keys"]
        exact = len(keys) == len(set(keys)) == args.images
        print(
            f"\nfault run (+50 ms, 5% of responses reset): {resets} resets, {len(keys)} samples, "
            f"{len(set(keys))} distinct, every sample exactly once: {exact}, "
            f"{fault['bytes'] / fault['seconds'] / 1e6:,.0f} MB/s"
        )
    finally:
        for p in procs:
            stop(p)


if __name__ == "__main__":
    main()
