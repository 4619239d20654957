"""Reading speed and memory: shardkit (tar streaming and LMDB random access) against the
plain-files baseline and webdataset.

One run, contestants interleaved round after round (the order rotating, so that none always
runs first or last), each in a fresh process, page cache warm. Medians with min-max; each
ratio is the median over rounds of the contestant against the limit measured in the same
round (this 2-core machine drifts by a third between rounds, so the ratio of two medians
taken minutes apart would mostly measure the drift):

- raw: samples/s and MB/s reading the shards in one process, against `cat` of the same files,
  and against the floor of any reader that hands out `bytes`: one `pread` per member into a
  fresh `bytes`, every offset known in advance, no parsing (PREAD_FLOOR);
- decoded: images/s through DataLoader(num_workers=2, batch_size=64) (shardkit also with
  the batches made in the dataset, DataLoader(batch_size=None); LMDB and the plain files also
  with collate_fn=shardkit.collate) with the same
  decode + resize-to-224 + uint8 tensor code for everyone, against that code alone on
  2 processes with no loader (the decode limit);
- random access: samples/s and MB/s reading every sample once in a shuffled order, in one
  process, undecoded (TarDataset, LMDBDataset, the plain files), against one `pread` per
  sample with every offset known (RANDOM_FLOOR); TarDataset also among the decoded;
- image_transform(256, crop=224), the transform shardkit offers (JPEG by libjpeg-turbo, see
  docs/decoding.md): images/s through StreamingDataset(decode="raw", transform=...) and
  DataLoader(num_workers=2, batch_size=64) (also with the batches made in the dataset), against the same transform alone on 2 processes
  with no loader (the fast-path limit) and against the PIL decode limit above, round by
  round; the same transform with backend="pil" alone shows the per-core gain of the fast path,
  and decode="rgb8" alone (no resize), fast and PIL, the decoder's; the fast-path limit also
  with torch's default threads in each of its 2 processes (more threads than cores: a busy
  machine);
- in the main process (DataLoader(num_workers=0, batch_size=64, collate_fn=shardkit.collate),
  torch's default threads, as in a notebook or a preprocessing script): image_transform(256,
  crop=224) against the PIL transform of the decoded rows, round by round (shardkit.collate
  stacks with numpy: torch's default collate splits each stack over torch's threads, which on
  a busy machine costs more than either transform, see docs/decoding.md);
- time to first batch, peak RSS (main process + workers, sampled at 20 Hz; a page shared
  by several processes counts in each, a mapped file's cached pages count) and peak memory
  in use (anonymous + shared memory of the main process and its workers, each page once,
  page cache not counted; see shardkit.bench.memory.in_use).

Every clock starts after the contestant's imports and one full garbage collection
(`start_clock`).

    python -m bench.read --images 20000 --rounds 3
    python -m bench.read --rounds 7 --only "shardkit StreamingDataset(batch_size=64)" --only shardkit
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.readers import (
    BATCH,
    BATCHED,
    FAST,
    FAST_BATCHED,
    FAST_LIMIT,
    FAST_LIMIT_THREADS,
    FILES_FAST,
    LIMITS,
    LMDB_FAST,
    MAIN_FAST,
    MAIN_PIL,
    PIL_RGB8_LIMIT,
    PIL_TRANSFORM_LIMIT,
    PREAD_FLOOR,
    RANDOM,
    RANDOM_FLOOR,
    RGB8_LIMIT,
    TAR_MAP,
    WORKERS,
    ranged,
    run_contestant,
    shard_bytes,
)
from shardkit.bench.harness import ratio_spread, rotate
from shardkit.bench.memory import PeakRss


# ---------------------------------------------------------------- the driver


def warm(name: str, shards: str, photos: str) -> None:
    """Read the contestant's input once so that it starts from a warm page cache (the
    kernel here reclaims idle page cache proactively, so warming once at the start is not
    enough)."""
    jpgs, mdb = f"$(find {photos} -name '*.jpg')", f"{shards}.lmdb/data.mdb"
    files = {
        "plain files": jpgs,
        FILES_FAST: jpgs,
        **dict.fromkeys(LIMITS, jpgs),
        "plain files, shuffled": jpgs,
        "LMDB random access": mdb,
        LMDB_FAST: mdb,
        "LMDBDataset[i], shuffled": mdb,
    }.get(name, f"{shards}/*.tar")
    subprocess.run(f"cat {files} > /dev/null", shell=True, check=True)


def measure(name: str, shards: str, photos: str) -> dict:
    warm(name, shards, photos)
    cmd = [sys.executable, "-m", "bench.read", "--contestant", name, "--shards", shards, "--photos", photos]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    rss = PeakRss(pid=proc.pid)
    rss.start()
    out, _ = proc.communicate()
    rss.stop()
    if proc.returncode:
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    result["rss"] = rss.peak_total or 0
    result["in_use"] = rss.peak_in_use or 0
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    ap.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run this contestant (repeatable; its group's limit runs too); default: all",
    )
    ap.add_argument("--contestant", help=argparse.SUPPRESS)
    ap.add_argument("--shards", help=argparse.SUPPRESS)
    ap.add_argument("--photos", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.contestant:
        print(json.dumps(run_contestant(args.contestant, args.shards, args.photos)))
        return

    import shardkit
    from scripts.make_images import make_image_folder

    root = Path(args.dir)
    photos = root / f"photos-{args.images}"
    shards = root / f"shards-{args.images}"
    make_image_folder(photos, args.images, n_classes=100, seed=0)
    if not (shards / "index.json").exists():
        shutil.rmtree(shards, ignore_errors=True)
        shardkit.pack(str(photos), str(shards), max_size="256MB", progress=False)
    lmdb = Path(f"{shards}.lmdb")
    if not (lmdb / "index.json").exists():
        shutil.rmtree(lmdb, ignore_errors=True)
        shardkit.pack(str(shards), str(lmdb), format="lmdb", progress=False)
    subprocess.run(
        f"cat {shards}/*.tar {lmdb}/data.mdb > /dev/null; tar cf - -C {photos} . | cat > /dev/null",
        shell=True,
        check=True,
    )

    raw = ["cat (limit)", PREAD_FLOOR, "shardkit raw", "webdataset raw"]
    decoded = [
        "decode limit",
        "shardkit",
        BATCHED,
        "LMDB random access",
        LMDB_FAST,
        TAR_MAP,
        "plain files",
        FILES_FAST,
        "webdataset",
    ]
    fast = [FAST_LIMIT, FAST, FAST_BATCHED, PIL_TRANSFORM_LIMIT, FAST_LIMIT_THREADS, RGB8_LIMIT, PIL_RGB8_LIMIT]
    shuffled = list(RANDOM)
    main_process = [MAIN_PIL, MAIN_FAST]
    if args.only:
        names = raw[1:] + decoded[1:] + fast[1:] + shuffled[1:] + main_process[1:]  # the limits run with their group
        unknown = set(args.only) - set(names)
        if unknown:
            ap.error(f"unknown contestant {sorted(unknown)[0]!r}; one of: {', '.join(names)}")
        groups = [[g[0]] + [n for n in g[1:] if n in args.only] for g in (raw, decoded, fast, shuffled, main_process)]
        raw, decoded, fast, shuffled, main_process = (g if len(g) > 1 else [] for g in groups)
        decoded = decoded or (["decode limit"] if fast else [])  # the fast path's rows compare with it too
    results: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for name in (
            rotate(raw, r) + rotate(decoded, r) + rotate(fast, r) + rotate(shuffled, r) + rotate(main_process, r)
        ):
            results.setdefault(name, []).append(measure(name, str(shards), str(photos)))
            print(f"round {r + 1}: {name} done", file=sys.stderr)

    def rate(name: str, key: str = "items") -> list[float]:
        """Per round: `key` per second, or (key "cpu") images per CPU-second."""
        return [x["items"] / x["cpu"] if key == "cpu" else x[key] / x["seconds"] for x in results[name]]

    print(
        f"\n{args.images} images, {shard_bytes(str(shards)) / 1e9:.2f} GB of shards, {os.cpu_count()} CPUs, "
        f"{args.rounds} rounds; median (min-max)\n"
    )
    if raw:
        print("| raw read, 1 process | samples/s | MB/s | % of cat, by round |")
        print("|---|---|---|---|")
        cat = rate("cat (limit)", "bytes")
        for name in raw:
            mbs = rate(name, "bytes")
            print(f"| {name} | {ranged(rate(name))} | {ranged(mbs, 1e-6)} | {ratio_spread(mbs, cat)} |")
    if shuffled:
        print("\n| random access, shuffled, 1 process, undecoded | samples/s | MB/s | % of the pread floor, by round |")
        print("|---|---|---|---|")
        floor = rate(RANDOM_FLOOR)
        for name in shuffled:
            print(
                f"| {name} | {ranged(rate(name))} | {ranged(rate(name, 'bytes'), 1e-6)} | {ratio_spread(rate(name), floor)} |"
            )
    if decoded:
        print(
            f"\n| decoded, DataLoader(num_workers={WORKERS}, batch_size={BATCH}) | images/s | % of decode limit, "
            "by round | first batch s | peak RSS MB | peak in use MB |"
        )
        print("|---|---|---|---|---|---|")
        limit = rate("decode limit")
        for name in decoded:
            print(f"| {name} | {ranged(rate(name))} | {ratio_spread(rate(name), limit)} | {_memory(results[name])} |")
    if fast:
        print(
            f"\n| image_transform(256, crop=224), DataLoader(num_workers={WORKERS}, batch_size={BATCH}) | images/s "
            "| % of its limit, by round | x the PIL decode limit, by round | images per CPU-second | first batch s "
            "| peak RSS MB | peak in use MB |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name in ["decode limit", *fast]:
            mine = name not in (RGB8_LIMIT, PIL_RGB8_LIMIT)  # the rgb8 limits do other work
            print(
                f"| {name} | {ranged(rate(name))} | {ratio_spread(rate(name), rate(FAST_LIMIT)) if mine else '-'} | "
                f"{ratio_spread(rate(name), rate('decode limit'), '.2f', 'x')} | {ranged(rate(name, 'cpu'))} | "
                f"{_memory(results[name])} |"
            )
    if main_process:
        import torch

        print(
            f"\n| main process, DataLoader(num_workers=0, batch_size={BATCH}, collate_fn=shardkit.collate), torch's "
            "default threads "
            f"({torch.get_num_threads()}) | images/s | x the PIL transform's, by round | images per CPU-second "
            "| first batch s | peak RSS MB | peak in use MB |"
        )
        print("|---|---|---|---|---|---|---|")
        for name in main_process:
            print(
                f"| {name} | {ranged(rate(name))} | {ratio_spread(rate(name), rate(MAIN_PIL), '.2f', 'x')} "
                f"| {ranged(rate(name, 'cpu'))} | {_memory(results[name])} |"
            )


def _memory(runs: list[dict]) -> str:
    """A contestant's first batch, peak RSS and peak memory in use, for a table row."""
    firsts = [x["first"] for x in runs if x["first"] is not None]
    rss, in_use = ([x[k] for x in runs] for k in ("rss", "in_use"))
    return f"{ranged(firsts, digits=2) if firsts else '-'} | {ranged(rss, 1e-6)} | {ranged(in_use, 1e-6)}"


if __name__ == "__main__":
    main()
