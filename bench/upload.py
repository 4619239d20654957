"""Packing into a bucket behind a bandwidth-limited link: `shardkit pack` straight into S3
(moto on loopback) through tests/servers/latency_proxy.py at 50 ms and 20 MB/s a connection (both
directions), against the upstream ceiling: the same shards uploaded by curl, every one at
once (one PUT each, presigned), through the same proxy. Interleaved rounds, medians.

    python -m bench.upload --images 2000 --rounds 3
    python -m bench.upload --images 2000 --rounds 3 --server seaweedfs

(--server seaweedfs: SeaweedFS's S3 gateway instead of moto, whose CompleteMultipartUpload copies
every part into the object again, a metadata write on S3.)

Reported: MB/s of shard bytes into the bucket (pack: from its start, listing and encoding
included, to its index written), the share of the ceiling, the connections the proxy saw at
once at most, and the CPU seconds a round took of the uploader (the pack's processes, or
the curls), the server and the proxy: on a machine of few cores they share it, and what
the uploader takes the proxy and the server do not get.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bench.s3 import BUCKET, SERVERS, options, proxy_command, start_proxy, start_server
from shardkit.bench.harness import median, spread

SHARD = "24MB"


def watch_connections(control: int, stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], json.loads(proxy_command(control, "stats"))["active"])
        time.sleep(0.05)


def cpu_of(pid: int) -> float:
    """CPU seconds process `pid` has used (its threads; not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """CPU seconds of this process and of its children that have ended (a pack's pool, curls)."""
    used = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return sum(u.ru_utime + u.ru_stime for u in used)


def timed(control: int, fn: Callable[[], None], server: int, proxy: int) -> tuple[float, int, tuple[float, ...]]:
    """(seconds `fn()` took, most connections open through the proxy at once meanwhile, CPU
    seconds of the uploader, the server process and the proxy process meanwhile)."""
    stop, peak = threading.Event(), [0]
    watcher = threading.Thread(target=watch_connections, args=(control, stop, peak))
    watcher.start()
    before = own_cpu(), cpu_of(server), cpu_of(proxy)
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        took = time.perf_counter() - t0
        stop.set()
        watcher.join()
    after = own_cpu(), cpu_of(server), cpu_of(proxy)
    return took, peak[0], tuple(b - a for a, b in zip(before, after))


def pack_up(photos: Path, url: str, opts: dict) -> None:
    import shardkit

    shardkit.pack(str(photos), url, max_size=SHARD, workers=2, progress=False, storage_options=opts, overwrite=True)


def curl_up(shards: list[Path], proxied: str, endpoint: str, prefix: str) -> None:
    """Every shard PUT at once by its own curl, presigned for the upstream and sent through
    the proxy with the upstream's Host header (the one the signature covers)."""
    from urllib.parse import urlsplit

    import boto3

    creds = options(endpoint)
    s3 = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=creds["key"],
        aws_secret_access_key=creds["secret"],
        region_name="us-east-1",
    )
    host = f"Host: {urlsplit(endpoint).netloc}"
    procs = []
    for shard in shards:
        signed = s3.generate_presigned_url("put_object", Params={"Bucket": BUCKET, "Key": f"{prefix}/{shard.name}"})
        procs.append(
            subprocess.Popen(
                ["curl", "-sf", "-o", "/dev/null", "-H", host, "-T", str(shard), signed.replace(endpoint, proxied)]
            )
        )
    if any(p.wait() for p in procs):
        raise SystemExit("a curl upload failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    ap.add_argument("--conn-mbps", type=float, default=20)
    ap.add_argument("--server", choices=SERVERS, default="moto", help="the S3 server behind the proxy")
    args = ap.parse_args()

    import shardkit
    from scripts.make_images import make_image_folder

    root = Path(args.dir)
    photos, shards = root / f"photos-{args.images}", root / f"upload-shards-{args.images}-{SHARD}"
    make_image_folder(photos, args.images, n_classes=100, seed=0)
    if not (shards / "index.json").exists():
        shutil.rmtree(shards, ignore_errors=True)
        shardkit.pack(str(photos), str(shards), max_size=SHARD, progress=False)
    tars = sorted(shards.glob("*.tar"))
    size = sum(p.stat().st_size for p in tars)
    server, endpoint = start_server(args.server, root)  # the bucket made
    proxy, proxied, control = start_proxy(endpoint, 50, conn_mbps=args.conn_mbps)
    try:
        runs: dict[str, list[tuple[float, int, tuple[float, ...]]]] = {
            "shardkit pack": [],
            "ceiling: curl, every shard at once": [],
        }
        for r in range(args.rounds):
            for name in runs:
                if name == "shardkit pack":
                    run = functools.partial(pack_up, photos, f"s3://{BUCKET}/pack-{r}", options(proxied))
                else:
                    run = functools.partial(curl_up, tars, proxied, endpoint, f"curl-{r}")
                runs[name].append(timed(control, run, server.proc.pid, proxy.proc.pid))
                took, peak, cpu = runs[name][-1]
                print(
                    f"round {r + 1} {name}: {size / took / 1e6:.1f} MB/s, {peak} connections, CPU s "
                    f"{' / '.join(f'{c:.1f}' for c in cpu)} (uploader / server / proxy) in {took:.1f} s",
                    file=sys.stderr,
                )
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(
            f"\n{when}, `python -m bench.upload --images {args.images} --rounds {args.rounds} --server {args.server}`: "
            f"{len(tars)} shards, {size / 1e6:.0f} MB, into {args.server} through 50 ms and {args.conn_mbps:g} MB/s a "
            f"connection; median (min-max) of {args.rounds} interleaved rounds\n"
        )
        print(
            "| MB/s into the bucket | MB/s | share of the ceiling | connections at once "
            f"| CPU s a round: uploader / server / proxy (of {os.cpu_count()} cores x seconds) |"
        )
        print("|---|---|---|---|---|")
        ceiling = median([size / t / 1e6 for t, _, _ in runs["ceiling: curl, every shard at once"]])
        for name, values in runs.items():
            rates = [size / t / 1e6 for t, _, _ in values]
            cpu = " / ".join(f"{median([c[i] for _, _, c in values]):.1f}" for i in range(3))
            print(
                f"| {name} | {spread(rates, digits=1)} | {median(rates) / ceiling:.0%} | "
                f"{median([p for _, p, _ in values]):.0f} | {cpu} (of {os.cpu_count()} x "
                f"{median([t for t, _, _ in values]):.1f}) |"
            )
    finally:
        for p in (proxy, server):
            p.stop()


if __name__ == "__main__":
    main()
