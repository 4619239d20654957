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
  page cache not counted; see shardkit.tools.bench.in_use).

Every clock starts after the contestant's imports and one full garbage collection
(`start_clock`).

    python scripts/bench_read.py --images 20000 --rounds 3
    python scripts/bench_read.py --rounds 7 --only "shardkit StreamingDataset(batch_size=64)" --only shardkit
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from shardkit.tools.bench import PeakRss

sys.path.insert(0, str(Path(__file__).resolve().parent))

BATCH = 64
WORKERS = 2
SIZE = 224
BATCHED = "shardkit StreamingDataset(batch_size=64)"
LMDB_FAST = "LMDBDataset, collate_fn=shardkit.collate"
FILES_FAST = "plain files, collate_fn=shardkit.collate"
PREAD_FLOOR = "pread per member (no parsing)"
TAR_MAP = "TarDataset random access"
RANDOM_FLOOR = "pread per sample, shuffled (no parsing)"
RANDOM = [RANDOM_FLOOR, "TarDataset[i], shuffled", "LMDBDataset[i], shuffled", "plain files, shuffled"]
FAST_LIMIT = "image_transform(256, crop=224) limit"
PIL_TRANSFORM_LIMIT = "image_transform(..., backend='pil') limit"
FAST = "shardkit, image_transform(256, crop=224)"
FAST_BATCHED = "shardkit StreamingDataset(batch_size=64), image_transform"
FAST_LIMIT_THREADS = "image_transform(256, crop=224) limit, torch's default threads"
MAIN_PIL = "shardkit, PIL transform, num_workers=0"
MAIN_FAST = "shardkit, image_transform(256, crop=224), num_workers=0"
RGB8_LIMIT = "decode='rgb8' limit (no resize)"
PIL_RGB8_LIMIT = "decode='rgb8', backend='pil' limit"


def decode_resize(data: bytes) -> "torch.Tensor":  # noqa: F821
    """The per-image work every contestant does: JPEG -> RGB -> 224x224 -> CHW uint8."""
    import torch

    img = Image.open(io.BytesIO(data)).convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.asarray(img).transpose(2, 0, 1).copy())


def _transform(backend: str = "auto"):  # type: ignore[no-untyped-def]
    from shardkit.decode import image_transform

    return image_transform(256, crop=SIZE, backend=backend)


def shardkit_transform(sample: dict) -> tuple:
    return decode_resize(sample["jpg"]), sample["cls"]


def wds_transform(sample: dict) -> tuple:
    return decode_resize(sample["jpg"]), int(sample["cls"])


class Files:
    """What users start from: an ImageFolder-like map-style dataset over the original files."""

    def __init__(self, root: str):
        classes = sorted(os.listdir(root))
        self.items = [
            (os.path.join(root, c, f), i)
            for i, c in enumerate(classes)
            for f in sorted(os.listdir(os.path.join(root, c)))
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple:
        path, label = self.items[i]
        with open(path, "rb") as f:
            return decode_resize(f.read()), label


# ---------------------------------------------------------------- one contestant, in its own process


def start_clock() -> float:
    """A contestant's clock, started after one full garbage collection. A fresh process that
    imported torch runs its first full collection (over torch's objects: ~0.15 s here) at
    its next burst of allocations, which lands in whichever first batch or pass comes first;
    a training script has run it long before (building its model)."""
    gc.collect()
    return time.perf_counter()


def _loader_pass(loader) -> tuple[float, float, int, float]:  # type: ignore[no-untyped-def]
    start, cpu = start_clock(), _cpu()
    first = None
    n = 0
    for images, _ in loader:
        if first is None:
            first = time.perf_counter() - start
        n += len(images)
    # the iterator, run out, has shut down its workers and waited for them: their CPU time counts
    return first or 0.0, time.perf_counter() - start, n, _cpu() - cpu


def _cpu() -> float:
    """CPU seconds of this process and of its children that have exited (DataLoader workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_contestant(name: str, shards: str, photos: str) -> dict:
    from torch.utils.data import DataLoader

    if name in LIMITS:
        files = [str(p) for p in sorted(Path(photos).rglob("*.jpg"))]
        halves = [(name, files[i::WORKERS]) for i in range(WORKERS)]
        import multiprocessing as mp

        with mp.get_context("fork").Pool(WORKERS) as pool:
            blobs = pool.map(_read_all, halves)  # bytes in memory before the clock starts
            del blobs
            start = start_clock()
            counts = pool.map(_decode_all, halves)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "items": sum(n for n, _ in counts), "cpu": sum(c for _, c in counts), "first": None}
    if name == "cat (limit)":
        start = start_clock()
        subprocess.run(f"cat {shards}/*.tar > /dev/null", shell=True, check=True)
        size = sum(p.stat().st_size for p in Path(shards).glob("*.tar"))
        return {"seconds": time.perf_counter() - start, "items": _samples(shards), "bytes": size, "first": None}
    if name == PREAD_FLOOR:
        import tarfile

        members = []
        for url in _urls(shards):
            with tarfile.open(url) as tar:
                members.append((url, [(m.offset_data, m.size) for m in tar.getmembers()]))
        start = start_clock()
        for url, spans in members:
            fd = os.open(url, os.O_RDONLY)
            try:
                for offset, size in spans:
                    os.pread(fd, size, offset)
            finally:
                os.close(fd)
        return {
            "seconds": time.perf_counter() - start,
            "items": _samples(shards),
            "bytes": _shard_bytes(shards),
            "first": None,
        }
    if name in RANDOM:
        return _shuffled(name, shards, photos)
    if name == "shardkit raw":
        from shardkit import StreamingDataset

        start = start_clock()
        n = size = 0
        for sample in StreamingDataset(shards):
            n += 1
            size += len(sample["jpg"]) + len(sample["json"])
        return {"seconds": time.perf_counter() - start, "items": n, "bytes": _shard_bytes(shards), "first": None}
    if name == "webdataset raw":
        import webdataset as wds

        start = start_clock()
        n = 0
        for _ in wds.WebDataset(_urls(shards), shardshuffle=False, empty_check=False):
            n += 1
        return {"seconds": time.perf_counter() - start, "items": n, "bytes": _shard_bytes(shards), "first": None}
    if name == "shardkit":
        from shardkit import StreamingDataset

        ds = StreamingDataset(shards, shuffle=True, transform=shardkit_transform)
        loader = DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    elif name == BATCHED:
        from shardkit import StreamingDataset

        ds = StreamingDataset(shards, shuffle=True, transform=shardkit_transform, batch_size=BATCH)
        loader = DataLoader(ds, batch_size=None, num_workers=WORKERS)
    elif name in ("LMDB random access", LMDB_FAST):
        import shardkit

        ds = shardkit.LMDBDataset(shards + ".lmdb", transform=shardkit_transform)
        collate = shardkit.collate if name == LMDB_FAST else None
        loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS, collate_fn=collate)
    elif name == TAR_MAP:
        import shardkit

        ds = shardkit.TarDataset(shards, transform=shardkit_transform)
        loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    elif name in ("plain files", FILES_FAST):
        import shardkit

        collate = shardkit.collate if name == FILES_FAST else None
        loader = DataLoader(Files(photos), batch_size=BATCH, shuffle=True, num_workers=WORKERS, collate_fn=collate)
    elif name in (FAST, FAST_BATCHED):
        from shardkit import StreamingDataset

        batched = name == FAST_BATCHED
        ds = StreamingDataset(
            shards, shuffle=True, decode="raw", transform=_transform(), batch_size=BATCH if batched else None
        )
        loader = DataLoader(ds, batch_size=None if batched else BATCH, num_workers=WORKERS)
    elif name in (MAIN_PIL, MAIN_FAST):
        from shardkit import StreamingDataset

        fast = name == MAIN_FAST
        ds = StreamingDataset(
            shards, shuffle=True, decode="raw", transform=_transform() if fast else shardkit_transform
        )
        import shardkit  # torch's threads as the process has them

        loader = DataLoader(ds, batch_size=BATCH, num_workers=0, collate_fn=shardkit.collate)
    elif name == "webdataset":
        import webdataset as wds

        ds = wds.WebDataset(_urls(shards), shardshuffle=100, empty_check=False).shuffle(1000).map(wds_transform)
        loader = DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    else:
        raise SystemExit(f"unknown contestant {name}")
    first, seconds, n, cpu = _loader_pass(loader)
    return {"seconds": seconds, "items": n, "cpu": cpu, "first": first}


def _shuffled(name: str, shards: str, photos: str) -> dict:
    """Every sample once, in a shuffled order, undecoded (`cls` and `json` aside)."""
    import shardkit

    order = np.random.default_rng(0).permutation(_samples(shards)).tolist()
    if name == RANDOM_FLOOR:
        idx = json.loads((Path(shards) / "index.json").read_text())
        spans = [
            (os.path.join(shards, s["name"]), a, b)
            for s in idx["shards"]
            for a, b in zip(s["offsets"], s["offsets"][1:])
        ]
        fds = {path: os.open(path, os.O_RDONLY) for path, _, _ in spans}
        start, size = start_clock(), 0
        for i in order:
            path, a, b = spans[i]
            size += len(os.pread(fds[path], b - a, a))
        return {"seconds": time.perf_counter() - start, "items": len(order), "bytes": size, "first": None}
    if name == "plain files, shuffled":
        paths = [p for p, _ in Files(photos).items]
        read = lambda i: Path(paths[i]).read_bytes()  # noqa: E731
    else:
        ds = shardkit.TarDataset(shards) if name.startswith("Tar") else shardkit.LMDBDataset(shards + ".lmdb")
        read = lambda i: ds[i]["jpg"]  # noqa: E731
    start, size = start_clock(), 0
    for i in order:
        size += len(read(i))
    return {"seconds": time.perf_counter() - start, "items": len(order), "bytes": size, "first": None}


def _read_all(job: tuple[str, list[str]]) -> int:
    global _BLOBS
    _BLOBS = [Path(p).read_bytes() for p in job[1]]
    return len(_BLOBS)


def _decode_all(job: tuple[str, list[str]]) -> tuple[int, float]:
    """The work on this process's share, and the CPU seconds it took."""
    import torch

    if job[0] != FAST_LIMIT_THREADS:
        torch.set_num_threads(1)  # as in a DataLoader worker
    work = LIMITS[job[0]]()
    cpu = time.process_time()
    for data in _BLOBS:
        work(data)
    return len(_BLOBS), time.process_time() - cpu


def _sample_transform(backend: str):  # type: ignore[no-untyped-def]
    transform = _transform(backend)
    return lambda data: transform({"jpg": data, "cls": 0})


def _rgb8(backend: str):  # type: ignore[no-untyped-def]
    from shardkit.decode import decoder

    decode = decoder("rgb8", backend)
    return lambda data: decode({"jpg": data})


# a limit's name -> its per-image work (made in the worker)
LIMITS = {
    "decode limit": lambda: decode_resize,
    FAST_LIMIT: lambda: _sample_transform("auto"),
    FAST_LIMIT_THREADS: lambda: _sample_transform("auto"),
    PIL_TRANSFORM_LIMIT: lambda: _sample_transform("pil"),
    RGB8_LIMIT: lambda: _rgb8("auto"),
    PIL_RGB8_LIMIT: lambda: _rgb8("pil"),
}


_BLOBS: list[bytes] = []


def _urls(shards: str) -> list[str]:
    return [str(p) for p in sorted(Path(shards).glob("*.tar"))]


def _shard_bytes(shards: str) -> int:
    return sum(p.stat().st_size for p in Path(shards).glob("*.tar"))


def _samples(shards: str) -> int:
    return json.loads((Path(shards) / "index.json").read_text())["samples"]


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
    cmd = [sys.executable, __file__, "--contestant", name, "--shards", shards, "--photos", photos]
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


def _fmt(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    med = statistics.median(values) * scale
    return f"{med:,.{digits}f} ({min(values) * scale:,.{digits}f}-{max(values) * scale:,.{digits}f})"


def rotate(names: list[str], r: int) -> list[str]:
    """Round r's order: the list turned by r places."""
    k = r % max(len(names), 1)
    return names[k:] + names[:k]


def ratio(values: list[float], limits: list[float]) -> str:
    """Median (min-max) over rounds of value / limit, round by round."""
    ratios = [v / x for v, x in zip(values, limits)]
    if not ratios:
        return "–"
    return f"{statistics.median(ratios):.0%} ({min(ratios):.0%}-{max(ratios):.0%})"


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

    from make_images import make_image_folder

    import shardkit

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
        f"\n{args.images} images, {_shard_bytes(str(shards)) / 1e9:.2f} GB of shards, {os.cpu_count()} CPUs, "
        f"{args.rounds} rounds; median (min-max)\n"
    )
    if raw:
        print("| raw read, 1 process | samples/s | MB/s | % of cat, by round |")
        print("|---|---|---|---|")
        cat = rate("cat (limit)", "bytes")
        for name in raw:
            mbs = rate(name, "bytes")
            print(f"| {name} | {_fmt(rate(name))} | {_fmt(mbs, 1e-6)} | {ratio(mbs, cat)} |")
    if shuffled:
        print("\n| random access, shuffled, 1 process, undecoded | samples/s | MB/s | % of the pread floor, by round |")
        print("|---|---|---|---|")
        floor = rate(RANDOM_FLOOR)
        for name in shuffled:
            print(f"| {name} | {_fmt(rate(name))} | {_fmt(rate(name, 'bytes'), 1e-6)} | {ratio(rate(name), floor)} |")
    if decoded:
        print(
            f"\n| decoded, DataLoader(num_workers={WORKERS}, batch_size={BATCH}) | images/s | % of decode limit, "
            "by round | first batch s | peak RSS MB | peak in use MB |"
        )
        print("|---|---|---|---|---|---|")
        limit = rate("decode limit")
        for name in decoded:
            print(f"| {name} | {_fmt(rate(name))} | {ratio(rate(name), limit)} | {_memory(results[name])} |")
    if fast:
        print(
            f"\n| image_transform(256, crop=224), DataLoader(num_workers={WORKERS}, batch_size={BATCH}) | images/s "
            "| % of its limit, by round | x the PIL decode limit, by round | images per CPU-second | first batch s "
            "| peak RSS MB | peak in use MB |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name in ["decode limit", *fast]:
            times = [v / x for v, x in zip(rate(name), rate("decode limit"))]
            mine = name not in (RGB8_LIMIT, PIL_RGB8_LIMIT)  # the rgb8 limits do other work
            print(
                f"| {name} | {_fmt(rate(name))} | {ratio(rate(name), rate(FAST_LIMIT)) if mine else '-'} | "
                f"{statistics.median(times):.2f}x ({min(times):.2f}-{max(times):.2f}) | {_fmt(rate(name, 'cpu'))} | "
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
            times = [v / x for v, x in zip(rate(name), rate(MAIN_PIL))]
            print(
                f"| {name} | {_fmt(rate(name))} | {statistics.median(times):.2f}x ({min(times):.2f}-{max(times):.2f}) "
                f"| {_fmt(rate(name, 'cpu'))} | {_memory(results[name])} |"
            )


def _memory(runs: list[dict]) -> str:
    """A contestant's first batch, peak RSS and peak memory in use, for a table row."""
    firsts = [x["first"] for x in runs if x["first"] is not None]
    rss, in_use = ([x[k] for x in runs] for k in ("rss", "in_use"))
    return f"{_fmt(firsts, digits=2) if firsts else '-'} | {_fmt(rss, 1e-6)} | {_fmt(in_use, 1e-6)}"


if __name__ == "__main__":
    main()
