"""The cost of global batches (StreamingDataset(global_batch_size=B)) against the default
order: bytes fetched and GET requests over a whole epoch of W ranks, and samples/s, from a
local S3 server (moto) directly and through a TCP proxy adding first-byte latency, and from
local disk (speed only: a local read sends no request). Each rank's share is read in one
process, raw samples, read-ahead on, ranks one after another (the epoch's totals are the
ranks' sums); rounds interleave the modes. Medians.

    python -m bench.global_batches --images 3000 --shard-size 16MB --world 8 --batch 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from bench.s3 import BUCKET, PREFETCH_ON, options, proxy_command, start_moto, start_proxy
from shardkit.bench.harness import median


def epoch(url: str, opts: dict | None, world: int, batch: int | None, block: int) -> dict[str, float]:
    """One epoch as `world` ranks read it, one rank after the other."""
    from shardkit import StreamingDataset

    out = {"samples": 0.0, "seconds": 0.0, "fetched_bytes": 0.0, "requests": 0.0}
    for rank in range(world):
        ds = StreamingDataset(
            url,
            storage_options=opts,
            prefetch=PREFETCH_ON,
            shuffle=True,
            seed=1,
            rank=rank,
            world_size=world,
            global_batch_size=batch,
            block=block,
        )
        t0 = time.perf_counter()
        n = sum(1 for _ in ds)
        out["seconds"] += time.perf_counter() - t0
        stats = ds.stats()
        out["samples"] += n
        out["fetched_bytes"] += stats["fetched_bytes"]
        out["requests"] += stats["requests"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256, help="global batch size of the global mode")
    ap.add_argument("--latency", type=float, default=100, help="ms the proxy adds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shard-size", default="64MB")
    ap.add_argument(
        "--global-block",
        type=int,
        nargs="*",
        default=[64],
        help="the block sizes to run the global mode with (the default order runs with 64)",
    )
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    args = ap.parse_args()

    import fsspec.core

    import shardkit
    from scripts.make_images import make_image_folder

    root = Path(args.dir)
    photos, shards = root / f"photos-{args.images}", root / f"remote-shards-{args.images}-{args.shard_size}"
    make_image_folder(photos, args.images, n_classes=100, seed=0)
    if not (shards / "index.json").exists():
        shutil.rmtree(shards, ignore_errors=True)
        shardkit.pack(str(photos), str(shards), max_size=args.shard_size, progress=False)
    total = sum(p.stat().st_size for p in shards.glob("*.tar"))
    moto, endpoint = start_moto()
    proxy, purl, control = start_proxy(endpoint, args.latency)
    try:
        fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}", **options(endpoint))
        fs.mkdir(BUCKET)
        fs.put(str(shards), f"{BUCKET}/ds", recursive=True)
        url = f"s3://{BUCKET}/ds"
        sources = {
            "local disk": (str(shards), None),
            "S3": (url, options(endpoint)),
            f"S3 +{args.latency:g} ms": (url, options(purl)),
        }
        modes = {
            "default": (None, 64),
            **{
                f"global_batch_size={args.batch}" + (f", block={b}" if b != 64 else ""): (args.batch, b)
                for b in args.global_block
            },
        }
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for source, (src, opts) in sources.items():
                for mode, (batch, block) in modes.items():
                    before = json.loads(proxy_command(control, "stats"))
                    got = epoch(src, opts, args.world, batch, block)
                    after = json.loads(proxy_command(control, "stats"))
                    got["proxy_requests"] = after["requests"] - before["requests"]
                    runs.setdefault((source, mode), []).append(got)
            print(f"round {r + 1} done", file=sys.stderr)
    finally:
        for p in (proxy, moto):
            p.stop()
    print(
        f"\n{args.images} images, {total / 1e6:.0f} MB in {len(list(shards.glob('*.tar')))} shards, an epoch of "
        f"{args.world} ranks read one after another, raw samples, {args.rounds} rounds; medians\n"
    )
    print("| source | order | samples/s | vs default | bytes fetched / dataset | GET requests | vs default |")
    print("|---|---|---|---|---|---|---|")
    for source in sources:
        base = runs[(source, "default")]
        base_rate = median(x["samples"] / x["seconds"] for x in base)
        base_requests = median(x["requests"] for x in base)
        for mode in modes:
            xs = runs[(source, mode)]
            rate = median(x["samples"] / x["seconds"] for x in xs)
            requests = median(x["requests"] for x in xs)
            fetched = median(x["fetched_bytes"] for x in xs) / total
            remote = source != "local disk"
            print(
                f"| {source} | {mode} | {rate:,.0f} | {rate / base_rate:.2f}x | "
                f"{f'{fetched:.2f}x' if remote else '-'} | {f'{requests:,.0f}' if remote else '-'} | "
                f"{f'{requests / base_requests:.2f}x' if remote and base_requests else '-'} |"
            )


if __name__ == "__main__":
    main()
