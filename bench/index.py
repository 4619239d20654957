"""What a dataset's size costs a reader, from 10 thousand to 1 billion samples: building
StreamingDataset from index.json, the memory each rank keeps, the pickle a spawned worker
receives, a worker's epoch start (its plan, then its samples' offsets out of the sidecar)
at world sizes 8 and 512 (8 workers a rank), and an elastic re-plan from a checkpoint
taken under 8 ranks. A worker's memory is its allocations' peak (tracemalloc) and its
private dirty pages after the plan (what it owns; the sidecar's pages are page cache).

Synthetic datasets, index files only (index.json of version 2 and its sidecar of offsets,
written once under --dir; no shard exists and none is read). Every measurement runs in a
fresh process, the sizes interleaved round after round; each worker-side measurement in a
child forked from the rank that built the dataset, as a DataLoader worker is. Medians.

    python -m bench.index --samples 10000 1000000 10000000 100000000 1000000000
    python -m bench.index --samples 10000000 --version 1   # the same dataset, index of version 1
    python -m bench.index --samples --parts 100 1000       # mixtures of 1M samples in 100, 1000 parts
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from shardkit.bench.harness import median

MEASURE = r"""
import gc, json, multiprocessing, os, pickle, resource, sys, time, tracemalloc
import torch  # imported before the baseline, as in a training script
from shardkit import StreamingDataset
from shardkit.order import ranges
from shardkit.bench.memory import rss

WORKERS = 8


def private() -> int:
    # the worker's own memory: pages it wrote (its allocations, copies of its parent's); the
    # sidecar's pages it maps are the page cache's, shared by the machine's processes
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Private_Dirty"))


def in_worker(ds, world, resume, traced, out):
    # a forked worker of rank world // 2: its plan, its samples' offsets, its reads (what a pass does first)
    if resume is not None:
        ds.load_state_dict(resume)
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    stream = ds._pass(world // 2, world, 3, WORKERS)
    ids = ds.ids_at(stream.epoch, next(stream._chunks()))  # a pass plans a piece of its stream at a time
    src = ds._samples
    shard_of, starts, ends = ranges.bounds(ids, src.first, src.offsets)
    reads, range_of = ranges.coalesce(shard_of, starts, ends, 16 << 20)  # a local dataset's read plan
    took = time.perf_counter() - start
    out.put((took, tracemalloc.get_traced_memory()[1], private(), len(ids)))


def forked(ds, world, resume=None):
    # twice: timed, then traced (tracemalloc slows every allocation of Python objects)
    ctx = multiprocessing.get_context("fork")
    got = []
    for traced in (False, True):
        q = ctx.Queue()
        p = ctx.Process(target=in_worker, args=(ds, world, resume, traced, q))
        p.start()
        got.append(q.get())
        p.join()
    (took, _, _, n), (_, peak, own, _) = got
    return took, peak, own, n


GLOBAL = int(sys.argv[2]) or None  # global_batch_size, or the default order
before = rss(os.getpid())
start = time.perf_counter()
ds = StreamingDataset(sys.argv[1], shuffle=True, rank=0, world_size=8, global_batch_size=GLOBAL)
took = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
gc.collect()
kept = rss(os.getpid()) - before
pickled = len(pickle.dumps(ds))
out = {"build_s": took, "build_peak": peak, "kept": kept, "pickle": pickled}
for world in (8, 512):
    t, p, u, n = forked(ds, world)
    out.update({f"start_s_{world}": t, f"start_peak_{world}": p, f"uss_{world}": u, f"share_{world}": n})
batch = ds.local_batch_size or 16
seen = len(ds) // 2 // batch * batch  # half an epoch under 8 ranks x 8 workers
state = ds.resume_state(epoch=0, samples_seen=seen, batch_size=batch, num_workers=WORKERS, world_size=8)
t, p, u, n = forked(StreamingDataset(sys.argv[1], shuffle=True, rank=0, world_size=512, global_batch_size=GLOBAL), 512,
                    state)
out.update({"replan_s": t, "replan_peak": p})
print(json.dumps(out))
"""


MIX = r"""
import json, multiprocessing, sys, time, tracemalloc
import torch
from shardkit import StreamingDataset
from shardkit.reading.mix import _part_ids

parts = [(folder, 1.0) for folder in sys.argv[1:]]
mix = StreamingDataset.mix(parts, shuffle=True, seed=1)
out = {}


def in_worker(world, traced, q):
    if traced:
        tracemalloc.start()
    start = time.perf_counter()
    stream = mix._pass(world // 2, world, 1, 2)
    specs = [p.read_spec() for p in mix.parts]
    part_of, ids = _part_ids(mix.counts, mix.sizes, specs, mix.seed, mix.shuffle, 0, next(stream._chunks()))
    q.put((time.perf_counter() - start, tracemalloc.get_traced_memory()[1]))


for world in (1, 512):  # 2 workers a rank; timed, then traced (tracemalloc slows allocations)
    for traced in (False, True):
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=in_worker, args=(world, traced, q))
        p.start()
        took, peak = q.get()
        p.join()
        out[f"peak_{world}" if traced else f"s_{world}"] = peak if traced else took
print(json.dumps(out))
"""


def shard_counts(samples: int, shards: int) -> np.ndarray:
    counts = np.full(shards, samples // shards, dtype=np.int64)
    counts[: samples % shards] += 1
    return counts


def write_dataset(folder: Path, samples: int, shards: int, version: int) -> None:
    """index.json and its sidecar: samples of ~110 KB (ImageNet-like), real offsets."""
    from shardkit.index import offsets

    counts = shard_counts(samples, shards)
    folder.mkdir(parents=True, exist_ok=True)
    entries = [
        {"name": f"shard-{i:06d}.tar", "samples": int(n), "bytes": int(n) * 110_000 + 1024, "sha256": f"{i:064x}"}
        for i, n in enumerate(counts)
    ]

    def tables():
        for n in counts:
            yield np.arange(n + 1, dtype=np.int64) * 110_000

    doc = {
        "format": "shardkit",
        "version": version,
        "kind": "tar",
        "samples": samples,
        "bytes": sum(e["bytes"] for e in entries),
        "fields": ["cls", "jpg"],
        "classes": [f"class_{i:04d}" for i in range(1000)],
        "plan": None,
        "skipped": [],
    }
    if version == 2:
        name = offsets.name_for((e["name"], e["samples"], e["bytes"], e["sha256"]) for e in entries)
        sha = offsets.write(str(folder / name), tables(), samples + shards)
        doc["offsets"] = {"file": name, "sha256": sha}
    else:
        entries = [{**e, "offsets": t.tolist()} for e, t in zip(entries, tables())]
    (folder / "index.json").write_text(json.dumps({**doc, "shards": entries}, separators=(",", ":")))


def measure(folder: Path, global_batch: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(folder), str(global_batch)], capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.splitlines()[-1])


def row(samples: int, shards: int, size: int, runs: list[dict[str, float]]) -> str:
    med = {k: median(r[k] for r in runs) for k in runs[0]}
    mb = 1e6
    return (
        f"| {samples:,} | {shards:,} | {size / mb:,.1f} | {med['build_s']:.3f} | {med['build_peak'] / mb:,.0f} | "
        f"{med['kept'] / mb:,.0f} | {med['pickle'] / mb:,.1f} | "
        f"{med['start_s_8']:.2f} / {med['start_peak_8'] / mb:,.0f} / {med['uss_8'] / mb:,.0f} | "
        f"{med['start_s_512']:.3f} / {med['start_peak_512'] / mb:,.1f} / {med['uss_512'] / mb:,.0f} | "
        f"{med['replan_s']:.3f} / {med['replan_peak'] / mb:,.1f} |"
    )


def mixtures(counts: list[int], rounds: int, root: Path) -> None:
    """A worker's epoch start in a mixture of 1M samples in `parts` datasets of one shard."""
    folders = {}
    for parts in counts:
        folders[parts] = [root / f"mix-{parts}" / f"part-{i}" for i in range(parts)]
        for folder in folders[parts]:
            if not (folder / "index.json").exists():
                write_dataset(folder, 1_000_000 // parts, 1, 2)
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in counts}
    for _ in range(rounds):
        for parts in counts:
            out = subprocess.run([sys.executable, "-c", MIX, *map(str, folders[parts])], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(out.stderr[-3000:])
            runs[parts].append(json.loads(out.stdout.splitlines()[-1]))
    print("mixtures of 1,000,000 samples, a worker's epoch start (its parts and samples): time s / peak MB")
    print("| parts | 1 rank x 2 workers | 512 ranks x 2 workers |")
    print("|---|---|---|")
    for parts in counts:
        med = {k: median(r[k] for r in runs[parts]) for k in runs[parts][0]}
        print(
            f"| {parts:,} | {med['s_1']:.3f} / {med['peak_1'] / 1e6:.1f} | {med['s_512']:.3f} / "
            f"{med['peak_512'] / 1e6:.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=float, nargs="*", default=[1e4, 1e6, 1e7, 1e8, 1e9])
    ap.add_argument("--shards", type=int, default=100_000, help="shards (at most one per 100 samples)")
    ap.add_argument("--version", type=int, choices=(1, 2), default=2, help="index version to write")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", type=int, nargs="*", default=[], help="also mixtures of 1M samples in this many parts")
    ap.add_argument("--dir", default="/tmp/shardkit-bench")
    ap.add_argument(
        "--global-batch",
        type=int,
        default=0,
        help="also global_batch_size=N (a multiple of 512: the table's world sizes split it)",
    )
    args = ap.parse_args()
    if args.parts:
        mixtures(args.parts, args.rounds, Path(args.dir))
    sizes = [(int(n), min(args.shards, int(n) // 100)) for n in args.samples]
    folders = {}
    for samples, shards in sizes:
        folder = Path(args.dir) / f"index-v{args.version}-{samples}-{shards}"
        if not (folder / "index.json").exists():
            write_dataset(folder, samples, shards, args.version)
        folders[samples] = folder
    if not sizes:
        return
    modes = [0] + ([args.global_batch] if args.global_batch else [])
    runs: dict[tuple[int, int], list[dict[str, float]]] = {(n, m): [] for n, _ in sizes for m in modes}
    for _ in range(args.rounds):
        for samples, _shards in sizes:  # interleaved: a busy moment of the machine hits every size
            for mode in modes:
                runs[(samples, mode)].append(measure(folders[samples], mode))
    for mode in modes:
        print(
            f"\n{f'global_batch_size={mode}' if mode else 'default order'}, index version {args.version}; "
            "per worker: time s / peak MB (tracemalloc) / private dirty MB"
        )
        print(
            "| samples | shards | index.json MB | build s | build peak MB | kept per rank MB | spawn pickle MB | "
            "epoch start, W=8 | epoch start, W=512 | elastic re-plan 8 -> 512 ranks |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for samples, shards in sizes:
            size = (folders[samples] / "index.json").stat().st_size
            print(row(samples, shards, size, runs[(samples, mode)]))


if __name__ == "__main__":
    main()
