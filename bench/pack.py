"""Packing speed: shardkit against webdataset's ShardWriter and `tar` (the physical limit).

Contestants run interleaved, round after round, on the same generated image folder with a
warm page cache; each run is a fresh process writing to the same disk. Prints medians with
min-max and the ratios the targets are stated in.

With --resize N it also packs with `--resize N --quality 90` (JPEGs decoded by the fast path,
docs/decoding.md) and, as the baseline, the same pack decoding every image with PIL (the fast
path switched off in that process): the same bytes come out, the time differs.

    python -m bench.pack --images 20000 --rounds 5 [--resize 256] [--max-count 667]

--max-count cuts shardkit's shards by count (2,000 images into 3 shards on 2 workers: the
third one's work runs on the cores the first two leave, docs/decoding.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts.make_images import make_image_folder
from shardkit.bench.harness import markdown_table, median, ratio_spread, spread

WDS_WRITER = """
import os, sys, webdataset as wds
src, dest, classes = sys.argv[1], sys.argv[2], sorted(os.listdir(sys.argv[1]))
os.makedirs(dest, exist_ok=True)
with wds.ShardWriter(os.path.join(dest, "shard-%06d.tar"), maxsize=256e6, verbose=0) as sink:
    n = 0
    for label, c in enumerate(classes):
        for root, _, files in sorted(os.walk(os.path.join(src, c))):
            for f in sorted(files):
                with open(os.path.join(root, f), "rb") as fh:
                    sink.write({"__key__": "%09d" % n, "jpg": fh.read(), "cls": str(label)})
                n += 1
"""
PIL_RESIZE = """
import sys, shardkit, shardkit.decode.jpeg
shardkit.decode.jpeg.decode = lambda data, at_least=None: None  # every image to PIL (workers fork with it)
shardkit.pack(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), max_size="256MB", resize=int(sys.argv[4]),
              quality=90, progress=False, max_count=int(sys.argv[5]) if len(sys.argv) > 5 else None)
"""


def contestants(
    src: Path, out: Path, workers: int, resize: int | None, max_count: int | None
) -> dict[str, list[str] | str]:
    count = ["--max-count", str(max_count)] if max_count else []
    shardkit = [
        sys.executable,
        "-m",
        "shardkit.cli",
        "pack",
        str(src),
        str(out),
        "--workers",
        str(workers),
        "--max-size",
        "256MB",
        *count,
        "-q",
    ]
    found: dict[str, list[str] | str] = {
        "tar (limit)": f"tar cf - -C {src} . | cat > /dev/null",
        f"shardkit ({workers} workers)": shardkit,
        "webdataset ShardWriter": [sys.executable, "-c", WDS_WRITER, str(src), str(out)],
    }
    if resize:
        found[f"shardkit --resize {resize} ({workers} workers)"] = [
            *shardkit,
            "--resize",
            str(resize),
            "--quality",
            "90",
        ]
        found[f"shardkit --resize {resize}, PIL decoding"] = [
            sys.executable,
            "-c",
            PIL_RESIZE,
            str(src),
            str(out),
            str(workers),
            str(resize),
            *count[1:],
        ]
    return found


def settle(src: Path) -> None:
    """The same start for every contestant: the previous one's output on disk (its
    writeback would otherwise run during the next one) and SRC in the page cache (the kernel
    here reclaims idle page cache, so warming once at the start is not enough)."""
    os.sync()
    subprocess.run(f"tar cf - -C {src} . | cat > /dev/null", shell=True, check=True)


def run(cmd: list[str] | str) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, shell=isinstance(cmd, str), check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/shardkit-bench", help="where the image folder and outputs go")
    ap.add_argument("--resize", type=int, help="also pack with --resize N, by the fast path and by PIL")
    ap.add_argument("--max-count", type=int, help="shardkit's shards: at most this many images each")
    args = ap.parse_args()

    root = Path(args.dir)
    src = root / f"photos-{args.images}"
    out = root / "pack-out"
    make_image_folder(src, args.images, n_classes=100, seed=0)
    files = [p for p in src.rglob("*.jpg")]
    total_bytes = sum(p.stat().st_size for p in files)
    print(f"{len(files)} images, {total_bytes / 1e9:.2f} GB, {os.cpu_count()} CPUs, {args.rounds} rounds")

    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for name, cmd in contestants(src, out, args.workers, args.resize, args.max_count).items():
            shutil.rmtree(out, ignore_errors=True)
            settle(src)
            times.setdefault(name, []).append(run(cmd))
    shutil.rmtree(out, ignore_errors=True)

    med = {name: median(t) for name, t in times.items()}
    rows = [
        [
            name,
            f"{len(files) / med[name]:,.0f}",
            f"{total_bytes / med[name] / 1e6:,.0f}",
            spread(t, 2, range_of_one=True),
        ]
        for name, t in times.items()
    ]
    print("\n" + markdown_table(["packer", "images/s", "MB/s", "seconds (median, min-max)"], rows))
    ours = next(n for n in med if n.startswith("shardkit"))
    print(
        f"\nshardkit / webdataset: {med['webdataset ShardWriter'] / med[ours]:.2f}x   "
        f"shardkit / tar limit: {med['tar (limit)'] / med[ours]:.0%}"
    )
    if args.resize:
        fast, pil = (
            next(n for n in med if n.startswith(f"shardkit --resize {args.resize}") and n.endswith(end))
            for end in ("workers)", "PIL decoding")
        )
        speedups = ratio_spread(times[pil], times[fast], ".2f", "x")
        print(f"--resize {args.resize}, fast path / PIL decoding: {speedups[:-1]}, by round)")


if __name__ == "__main__":
    main()
