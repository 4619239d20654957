"""What gzip-compressed shards cost to read: the same shards plain and gzipped (level 6, as
`tar czf` and webdataset's compress=True make them), read whole by StreamingDataset in one
process (raw: images undecoded), interleaved round after round, each in a fresh process,
page cache warm. Also: how much gzip saves on JPEG shards, what one sample in the middle of
a shard costs without random access (inflating everything before it), and inflating alone.

    python -m bench.gzipped --images 5000 --rounds 3
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from shardkit.bench.harness import median, rotate


def raw_pass(source: str) -> dict:
    from bench.readers import start_clock

    from shardkit import StreamingDataset

    ds = StreamingDataset(source)
    start, n, size = start_clock(), 0, 0
    for sample in ds:
        n += 1
        size += len(sample["jpg"])
    return {"seconds": time.perf_counter() - start, "samples": n, "bytes": size}


def middle_sample(source: str) -> dict:
    """One sample halfway through the first shard, from a fresh reader: a ranged read of a
    plain shard, inflating half the shard of a compressed one (StreamingDataset's own
    stand-in read, as TarDataset would need)."""
    from bench.readers import start_clock

    from shardkit import StreamingDataset, storage

    ds = StreamingDataset(source)
    middle = int(ds.index.shards[0].samples) // 2
    reader = storage.RangeReader(ds.urls)
    start = start_clock()
    ds._samples.one(middle, reader)
    return {"seconds": time.perf_counter() - start, "samples": 1, "bytes": 0}


def inflate(path: str) -> dict:
    from shardkit.formats.gzip import Inflater

    with open(path, "rb") as f:
        stream = Inflater(f.read, path)
        start, size = time.perf_counter(), 0
        while piece := stream.read(8 << 20):
            size += len(piece)
    return {"seconds": time.perf_counter() - start, "samples": 0, "bytes": size}


RUNS = {"raw pass": raw_pass, "one sample mid-shard": middle_sample}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    ap.add_argument("--run", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        kind, source = args.run
        print(json.dumps((inflate if kind == "inflate" else RUNS[kind])(source)))
        return

    from scripts.make_images import make_image_folder

    import shardkit

    root = Path(args.dir)
    photos, plain, packed = (root / f"{name}-{args.images}" for name in ("photos", "shards", "gz-shards"))
    make_image_folder(photos, args.images, n_classes=100, seed=0)
    if not (plain / "index.json").exists():
        shutil.rmtree(plain, ignore_errors=True)
        shardkit.pack(str(photos), str(plain), max_size="256MB", progress=False)
    if not (packed / "index.json").exists():
        packed.mkdir(parents=True, exist_ok=True)
        for shard in sorted(plain.glob("*.tar")):
            (packed / (shard.name + ".gz")).write_bytes(gzip.compress(shard.read_bytes(), 6))
        shardkit.index.save(shardkit.build_index(sorted(str(p) for p in packed.glob("*.tar.gz"))), str(packed))
    sizes = [sum(p.stat().st_size for p in d.glob(glob)) for d, glob in ((plain, "*.tar"), (packed, "*.tar.gz"))]
    first_gz = str(sorted(packed.glob("*.tar.gz"))[0])

    results: dict[tuple[str, str], list[dict]] = {}
    jobs = [(kind, name, str(source)) for kind in RUNS for name, source in (("plain", plain), ("gzip", packed))]
    jobs.append(("inflate", "gzip", first_gz))
    for r in range(args.rounds):
        for kind, name, source in rotate(jobs, r):
            subprocess.run(f"cat {plain}/*.tar {packed}/*.tar.gz > /dev/null", shell=True, check=True)
            out = subprocess.run(
                [sys.executable, "-m", "bench.gzipped", "--run", kind, source],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            results.setdefault((kind, name), []).append(json.loads(out.strip().splitlines()[-1]))
        print(f"round {r + 1} done", file=sys.stderr)

    def med(values: list[float]) -> str:
        def num(v: float) -> str:
            return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"

        return f"{num(median(values))} ({num(min(values))}-{num(max(values))})"

    print(
        f"\n{args.images} images: plain shards {sizes[0] / 1e6:.1f} MB, gzipped {sizes[1] / 1e6:.1f} MB "
        f"({sizes[1] / sizes[0]:.1%}); {args.rounds} rounds, median (min-max)\n"
    )
    print("| read | plain | gzip |")
    print("|---|---|---|")
    for label, kind, unit in (
        ("raw pass, samples/s", "raw pass", "samples"),
        ("one sample mid-shard, ms", "one sample mid-shard", "ms"),
    ):
        row = []
        for name in ("plain", "gzip"):
            xs = results[(kind, name)]
            row.append(
                med(
                    [x["samples"] / x["seconds"] for x in xs]
                    if unit == "samples"
                    else [x["seconds"] * 1000 for x in xs]
                )
            )
        print(f"| {label} | {row[0]} | {row[1]} |")
    mbs = [x["bytes"] / x["seconds"] / 1e6 for x in results[("inflate", "gzip")]]
    print(f"| inflating alone, MB/s of tar | | {med(mbs)} |")


if __name__ == "__main__":
    main()
