"""shardkit against its peers: webdataset, mosaicml-streaming, litdata and plain files.

One run on one generated image folder, page cache warm. Each round packs with every packer,
then reads every packed dataset raw, then through a DataLoader; contestants are interleaved
(their order rotates each round) and every measurement is a fresh process, timed after its
imports and one full garbage collection (bench/readers.py start_clock). Medians with min-max; a ratio to a limit is the median over rounds of the ratio
to the limit measured in the same round (shardkit.bench.harness.ratio_spread):

- pack: seconds and images/s, against `tar` of the image folder; shardkit with 2 workers,
  webdataset's ShardWriter (one process, it has no parallel writer), one MDSWriter per process
  + merge_index, litdata.optimize(num_workers=2); all aiming at 256 MB shards/chunks;
- raw read: samples/s in one process, and MB/s of the packed files against `cat` of shardkit's
  shards (litdata items are copied to bytes: it returns views into memory-mapped chunks);
- decoded: images/s through DataLoader(num_workers=2, batch_size=64) (litdata's own
  StreamingDataLoader; shardkit as it is meant for training, batch_size=64 on the dataset and
  batch_size=None on the DataLoader: bench/read.py compares both ways), the same decode + resize-to-224 + CHW uint8 code (bench/read.py's) for
  everyone, against that code alone on 2 processes with bytes preloaded and no loader (the
  PIL decode limit); the peers keep that PIL code, as their users write it;
- shardkit's image_transform(256, crop=224) (the transform shardkit offers: JPEG by libjpeg-turbo,
  docs/decoding.md) in its training setup, and that transform alone on 2 processes with no
  loader (the fast-path limit); its "% of decode limit" is against the PIL decode limit;
- first batch: seconds from building the dataset to the first batch; peak RSS of the
  decoded pass, main process + workers, sampled at 20 Hz, and peak memory in use (their
  anonymous + shared memory, each page once, page cache not counted; see
  shardkit.bench.memory.in_use).

"shardkit --resize 256" packs with resize=256, quality=90: its shards hold different (smaller)
images, so it is a what-if, not a like-for-like row.

Runs in .venv-peers (scripts/peers_setup.sh makes it; this script runs that and re-executes
itself there when started from another interpreter). A peer that failed to install or to run
is reported as "failed: <reason>". Writes bench-out/peers.md and peers.json (every measurement), and
peers-summary.json and peers.png (the README's table and chart: bench/peers_chart.py).

    .venv-peers/bin/python -m bench.peers --images 20000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-peers"


def _bootstrap() -> None:
    """Make sure .venv-peers is filled (the setup script is a no-op once stamped); move there."""
    subprocess.run(["bash", str(REPO / "scripts" / "peers_setup.sh")], check=True)
    if Path(sys.prefix).resolve() != VENV.resolve():
        python = str(VENV / "bin" / "python")
        os.execv(python, [python, "-m", "bench.peers", *sys.argv[1:]])


if __name__ == "__main__" and "--stage" not in sys.argv:
    _bootstrap()

import bench.readers as br  # noqa: E402  (decode_resize, Files, transforms, limits)
from bench.mosaic import import_streaming  # noqa: E402
from shardkit.bench.harness import median, ratio_spread, rotate  # noqa: E402
from shardkit.bench.memory import PeakRss  # noqa: E402

WORKERS, BATCH = br.WORKERS, br.BATCH
CHUNK = 256 * 1000 * 1000  # shard / chunk target for every packer (shardkit's "256MB")
RESIZE = "shardkit --resize 256"
FAST = "shardkit, image_transform(256, crop=224)"
PACKERS = ["tar (limit)", "shardkit", RESIZE, "webdataset", "mosaicml-streaming", "litdata"]
RAW = ["cat (limit)", "shardkit", RESIZE, "webdataset", "mosaicml-streaming", "litdata", "plain files"]
DECODED = [
    "decode limit",
    br.FAST_LIMIT,
    "shardkit",
    FAST,
    RESIZE,
    "webdataset",
    "mosaicml-streaming",
    "litdata",
    "plain files",
]
ROWS = ["shardkit", FAST, "webdataset", "mosaicml-streaming", "litdata", "plain files", RESIZE]
FOLDER = {
    "shardkit": "shardkit",
    FAST: "shardkit",
    RESIZE: "shardkit-resize256",
    "webdataset": "webdataset",
    "mosaicml-streaming": "mds",
    "litdata": "litdata",
}
DISTRIBUTION = {
    "shardkit": "shardkit",
    RESIZE: "shardkit",
    "webdataset": "webdataset",
    "mosaicml-streaming": "mosaicml-streaming",
    "litdata": "litdata",
}


# ---------------------------------------------------------------- peers' own code paths


def _items(photos: str) -> list[tuple[str, int]]:
    return br.Files(photos).items  # (path, label) in class order, the labels every reader sees


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _pack_wds(items: list[tuple[str, int]], out: str) -> None:
    import webdataset as wds

    os.makedirs(out)
    with wds.ShardWriter(os.path.join(out, "shard-%06d.tar"), maxsize=CHUNK, verbose=0) as sink:
        for n, (path, label) in enumerate(items):
            sink.write({"__key__": "%09d" % n, "jpg": _read(path), "cls": str(label)})


def _mds_part(job: tuple[str, list[tuple[str, int]]]) -> int:
    from streaming import MDSWriter

    out, items = job
    with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, compression=None, size_limit=CHUNK) as w:
        for path, label in items:
            w.write({"jpg": _read(path), "cls": label})
    return len(items)


def _pack_mds(items: list[tuple[str, int]], out: str) -> None:
    import multiprocessing as mp

    from streaming.base.util import merge_index

    jobs = [(os.path.join(out, f"part-{i}"), items[i::WORKERS]) for i in range(WORKERS)]
    with mp.get_context("fork").Pool(WORKERS) as pool:
        pool.map(_mds_part, jobs)
    merge_index(out, keep_local=True)


def _litdata_item(item: tuple[str, int]) -> dict:
    path, label = item
    return {"jpg": _read(path), "cls": label}


def _pack_litdata(items: list[tuple[str, int]], out: str) -> None:
    import litdata

    litdata.optimize(fn=_litdata_item, inputs=items, output_dir=out, chunk_bytes="256MB", num_workers=WORKERS)


def _mds_dataset(data: str, shuffle: bool, transform: bool):  # type: ignore[no-untyped-def]
    streaming = import_streaming()

    class Decoded(streaming.StreamingDataset):
        def __getitem__(self, i: int) -> tuple:
            s = super().__getitem__(i)
            return br.decode_resize(s["jpg"]), s["cls"]

    cls = Decoded if transform else streaming.StreamingDataset
    return cls(local=data, remote=None, shuffle=shuffle, batch_size=BATCH)


def _litdata_decode(sample: dict) -> tuple:
    return br.decode_resize(bytes(sample["jpg"])), sample["cls"]


def _litdata_dataset(data: str, shuffle: bool, transform: bool):  # type: ignore[no-untyped-def]
    import litdata

    return litdata.StreamingDataset(data, shuffle=shuffle, transform=_litdata_decode if transform else None)


# ---------------------------------------------------------------- one measurement, in its own process


def _dir_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def run_pack(name: str, data: str, photos: str) -> dict:
    items = len(_items(photos))
    if name == "tar (limit)":
        start = br.start_clock()
        subprocess.run(f"tar cf - -C {photos} . | cat > /dev/null", shell=True, check=True)
        return {"seconds": time.perf_counter() - start, "items": items, "bytes": 0}
    if name in ("shardkit", RESIZE):
        import shardkit

        resize = {"resize": 256, "quality": 90} if name == RESIZE else {}
        start = br.start_clock()
        shardkit.pack(photos, data, workers=WORKERS, max_size=CHUNK, progress=False, **resize)
    else:
        writer = {"webdataset": _pack_wds, "mosaicml-streaming": _pack_mds, "litdata": _pack_litdata}[name]
        if name == "mosaicml-streaming":
            import_streaming()
        else:
            __import__(DISTRIBUTION[name])
        start = br.start_clock()
        writer(_items(photos), data)  # listing the folder is timed, as it is inside shardkit.pack
    return {"seconds": time.perf_counter() - start, "items": items, "bytes": _dir_bytes(data)}


def run_raw(name: str, data: str, photos: str) -> dict:
    if name == "cat (limit)":
        return br.run_contestant("cat (limit)", data, photos)
    if name in ("shardkit", RESIZE):
        return br.run_contestant("shardkit raw", data, photos)
    if name == "webdataset":
        return br.run_contestant("webdataset raw", data, photos)
    if name == "plain files":
        paths = [p for p, _ in _items(photos)]
        start = br.start_clock()
        size = sum(len(_read(p)) for p in paths)
        return {"seconds": time.perf_counter() - start, "items": len(paths), "bytes": size}
    make = {"mosaicml-streaming": _mds_dataset, "litdata": _litdata_dataset}[name]
    if name == "litdata":
        import litdata  # noqa: F401
    else:
        import_streaming()
    start = br.start_clock()
    n = 0
    for sample in make(data, shuffle=False, transform=False):
        bytes(sample["jpg"])  # litdata: a view into the memory map until copied
        n += 1
    return {"seconds": time.perf_counter() - start, "items": n, "bytes": _dir_bytes(data)}


def run_decoded(name: str, data: str, photos: str) -> dict:
    if name in br.LIMITS:
        return br.run_contestant(name, data, photos)
    from torch.utils.data import DataLoader

    if name in ("shardkit", FAST, RESIZE):
        from shardkit import StreamingDataset

        transform = br.fast_transform() if name == FAST else br.shardkit_transform

        def make():  # type: ignore[no-untyped-def]
            # shardkit's training setup: batches made in the workers (see bench/read.py for both ways)
            ds = StreamingDataset(data, shuffle=True, transform=transform, batch_size=BATCH)
            return DataLoader(ds, batch_size=None, num_workers=WORKERS)
    elif name == "webdataset":
        import webdataset as wds

        def make():  # type: ignore[no-untyped-def]
            ds = wds.WebDataset(br.shard_urls(data), shardshuffle=100, empty_check=False).shuffle(1000)
            return DataLoader(ds.map(br.wds_transform), batch_size=BATCH, num_workers=WORKERS)
    elif name == "mosaicml-streaming":
        import_streaming()

        def make():  # type: ignore[no-untyped-def]
            return DataLoader(_mds_dataset(data, shuffle=True, transform=True), batch_size=BATCH, num_workers=WORKERS)
    elif name == "litdata":
        import litdata

        def make():  # type: ignore[no-untyped-def]
            ds = _litdata_dataset(data, shuffle=True, transform=True)
            return litdata.StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    elif name == "plain files":

        def make():  # type: ignore[no-untyped-def]
            return DataLoader(br.Files(photos), batch_size=BATCH, shuffle=True, num_workers=WORKERS)
    else:
        raise SystemExit(f"unknown contestant {name}")
    start = br.start_clock()
    loader = make()
    built = time.perf_counter() - start
    first, seconds, n, _ = br.loader_pass(loader)
    return {"seconds": seconds, "items": n, "first": built + first}


STAGES = {"pack": run_pack, "raw": run_raw, "decoded": run_decoded}


# ---------------------------------------------------------------- the driver


class Failed(Exception):
    pass


def measure(stage: str, name: str, data: str, photos: str, timeout: float) -> dict:
    """Run one measurement in a fresh process (its own session, so a hang can be killed whole)."""
    cmd = [
        sys.executable,
        "-m",
        "bench.peers",
        "--stage",
        stage,
        "--contestant",
        name,
        "--data",
        data,
        "--photos",
        photos,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    rss = PeakRss(pid=proc.pid)
    rss.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise Failed(f"timed out after {timeout:.0f} s") from None
    finally:
        rss.stop()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        why = [line.strip() for line in err.splitlines() if line.strip()]
        raise Failed(why[-1] if why else f"exit code {proc.returncode}")
    result = json.loads(lines[-1][len("RESULT ") :])
    result["rss"] = rss.peak_total or 0
    result["in_use"] = rss.peak_in_use or 0
    return result


def _install_failures() -> dict[str, str]:
    failed = VENV / "failed.txt"
    out = {}
    for line in failed.read_text().splitlines() if failed.exists() else []:
        name, _, why = line.partition(": ")
        out[name.strip()] = f"failed: {why.strip()}"
    return out


def _short(reason: str, width: int = 90) -> str:
    reason = " ".join(reason.split()).replace("|", "/")
    return reason if len(reason) <= width else reason[: width - 1] + "…"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def run_rounds(args: argparse.Namespace, photos: Path, work: Path) -> tuple[dict, dict]:
    import shutil

    results: dict[tuple[str, str], list[dict]] = {}
    failures: dict[tuple[str, str], str] = {}
    broken = _install_failures()
    for name, why in broken.items():
        for stage in STAGES:
            failures[(stage, name)] = why

    def data_of(name: str) -> str:
        if name == "plain files" or name in ("tar (limit)", *br.LIMITS):
            return str(photos)
        return str(work / FOLDER["shardkit" if name == "cat (limit)" else name])

    def one(stage: str, name: str, r: int) -> None:
        if (stage, name) in failures:
            return
        if stage != "pack" and name in FOLDER and ("pack", name) in failures:
            failures[(stage, name)] = "failed: no data (its pack failed)"
            return
        # its input in the page cache just before it runs (the kernel here reclaims idle page
        # cache, so warming once per stage would favour whoever runs first)
        warm = str(photos) if stage == "pack" else data_of(name)
        subprocess.run(f"find {warm} -type f -exec cat {{}} + > /dev/null", shell=True, check=False)
        try:
            res = measure(stage, name, data_of(name), str(photos), args.timeout)
        except Failed as e:
            failures[(stage, name)] = f"failed: {_short(str(e))}"
            print(f"round {r + 1}: {stage} {name} FAILED: {e}", file=sys.stderr)
            return
        results.setdefault((stage, name), []).append(res)
        print(f"round {r + 1}: {stage} {name}: {res['items'] / res['seconds']:,.0f}/s", file=sys.stderr)

    for r in range(args.rounds):
        for name in rotate(PACKERS, r):
            if name in FOLDER:
                shutil.rmtree(data_of(name), ignore_errors=True)
            one("pack", name, r)
            subprocess.run(["sync"], check=False)  # no write-back of one packer's output under the next
        for name in rotate(RAW, r):
            one("raw", name, r)
        for name in rotate(DECODED, r):
            one("decoded", name, r)
    return results, failures


def render(args: argparse.Namespace, photos: Path, results: dict, failures: dict) -> str:
    def rate(stage: str, name: str, key: str = "items") -> list[float]:
        return [x[key] / x["seconds"] for x in results.get((stage, name), [])]

    def med(values: list[float]) -> float:
        return median(values)

    cat = rate("raw", "cat (limit)", "bytes")
    limit = rate("decoded", "decode limit")

    def pack_cells(name: str) -> list[str]:
        if ("pack", name) in failures or name not in PACKERS:
            return [failures.get(("pack", name), "–"), "–", "–"]
        runs = results[("pack", name)]
        seconds = [x["seconds"] for x in runs]
        size = f"{med([x['bytes'] for x in runs]) / 1e9:.2f}" if runs[0]["bytes"] else "–"
        return [br.ranged(seconds, digits=1), f"{runs[0]['items'] / med(seconds):,.0f}", size]

    def raw_cells(name: str) -> list[str]:
        if ("raw", name) in failures or name not in RAW:
            return [failures.get(("raw", name), "–"), "–"]
        mbs = rate("raw", name, "bytes")
        return [br.ranged(rate("raw", name)), ratio_spread(mbs, cat)]

    def decoded_cells(name: str) -> list[str]:
        if ("decoded", name) in failures:
            return [failures[("decoded", name)], "–", "–", "–", "–"]
        runs = results[("decoded", name)]
        firsts = [x["first"] for x in runs if x.get("first") is not None]
        ips = rate("decoded", name)
        return [
            br.ranged(ips),
            ratio_spread(ips, limit),
            br.ranged(firsts, digits=2) if firsts else "–",
            br.ranged([x["rss"] for x in runs], 1e-6),
            br.ranged([x.get("in_use", 0) for x in runs], 1e-6),
        ]

    photo_bytes = sum(p.stat().st_size for p in photos.rglob("*.jpg"))
    versions = ", ".join(
        f"{d} {_version(d)}" for d in ("shardkit", "webdataset", "mosaicml-streaming", "litdata", "torch")
    )
    lines = [
        f"{args.images:,} images ({photo_bytes / 1e9:.2f} GB of JPEG), {os.cpu_count()} CPUs, {args.rounds} rounds, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; median (min-max); page cache warm",
        f"{versions}",
        "",
        f"| | pack s | pack images/s | packed GB | raw read samples/s, 1 process | raw MB/s, % of cat | "
        f"decoded images/s, DataLoader(num_workers={WORKERS}, batch_size={BATCH}) | % of decode limit | "
        "first batch s | peak RSS MB | peak in use MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # The limits row: tar of the photos, cat of shardkit's shards, decode on 2 processes with no loader.
    tar = [x["seconds"] for x in results.get(("pack", "tar (limit)"), [])]
    limit_cells = [
        failures.get(("pack", "tar (limit)")) or br.ranged(tar, digits=1),
        f"{args.images / med(tar):,.0f}" if tar else "–",
        "–",
        failures.get(("raw", "cat (limit)")) or br.ranged(rate("raw", "cat (limit)")),
        "100%",
        failures.get(("decoded", "decode limit")) or br.ranged(limit),
        "100%",
        "–",
        "–",
        "–",
    ]
    lines.append(f"| limits: `tar` / `cat` / decode on {WORKERS} processes | " + " | ".join(limit_cells) + " |")
    fast = rate("decoded", br.FAST_LIMIT)
    fast_cells = [failures.get(("decoded", br.FAST_LIMIT)) or br.ranged(fast), ratio_spread(fast, limit), "–", "–", "–"]
    lines.append(
        f"| limit: image_transform(256, crop=224) on {WORKERS} processes | "
        + " – |" * 5
        + " "
        + " | ".join(fast_cells)
        + " |"
    )
    broken = _install_failures()
    for name in ROWS:
        label = f"{name} (pack-time resize: smaller images, not like-for-like)" if name == RESIZE else name
        if name in broken:
            lines.append(f"| {label} | {_short(broken[name])} |" + " – |" * 9)
            continue
        lines.append("| " + " | ".join([label, *pack_cells(name), *raw_cells(name), *decoded_cells(name)]) + " |")

    notes = []
    for (stage, name), runs in sorted(results.items()):
        counts = sorted({x["items"] for x in runs})
        if stage != "pack" and name not in ("cat (limit)",) and counts != [args.images]:
            notes.append(f"- {stage} {name}: saw {', '.join(map(str, counts))} samples, not {args.images}")
    if notes:
        lines += ["", "Sample counts that differ from the image count:", *notes]
    return "\n".join(lines) + "\n"


LABELS = {
    "shardkit": "shardkit",
    "webdataset": "webdataset",
    "mosaicml-streaming": "mosaicml-streaming",
    "litdata": "litdata",
    "plain files": "plain files (ImageFolder + DataLoader)",
    FAST: FAST,
}  # the README's rows


def summary(args: argparse.Namespace, results: dict, failures: dict) -> dict:
    """What the README's table and docs/peers.png show (bench/peers_chart.py draws both from it): the
    README's rows, in its order; a contestant that failed is left out and named under "failed"."""

    def stat(stage: str, name: str, key: str = "items", per_second: bool = True) -> dict[str, float]:
        runs = results.get((stage, name), [])
        values = [x[key] / x["seconds"] if per_second else x[key] for x in runs if x.get(key) is not None]
        return {"median": median(values), "min": min(values), "max": max(values)}

    rows, failed = [], {}
    for name, label in LABELS.items():
        if ("decoded", name) in failures or ("decoded", name) not in results:
            failed[label] = failures.get(("decoded", name), "no result")
            continue
        pack = results.get(("pack", name))
        rows.append(
            {
                "label": label,
                "shardkit": name.startswith("shardkit"),
                "pack": args.images / median(x["seconds"] for x in pack) if pack else None,
                "decoded": stat("decoded", name),
                "first_batch_s": stat("decoded", name, "first", per_second=False)["median"],
                "peak_rss_mb": stat("decoded", name, "rss", per_second=False)["median"] / 1e6,
            }
        )
    return {
        "command": f".venv-peers/bin/python -m bench.peers --images {args.images} --rounds {args.rounds}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "images": args.images,
        "rounds": args.rounds,
        "workers": WORKERS,
        "batch": BATCH,
        "decode_limit": stat("decoded", "decode limit"),
        "rows": rows,
        "failed": failed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/shardkit-bench", help="image folder and packed outputs")
    ap.add_argument("--out", default=str(REPO / "bench-out"), help="where peers.md, .json and .png go")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before one measurement is killed")
    ap.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    ap.add_argument("--contestant", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--photos", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stage:
        print("RESULT " + json.dumps(STAGES[args.stage](args.contestant, args.data, args.photos)), flush=True)
        return

    from scripts.make_images import make_image_folder

    root = Path(args.dir)
    photos, work = root / f"photos-{args.images}", root / f"peers-{args.images}"
    make_image_folder(photos, args.images, n_classes=100, seed=0)
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results, failures = run_rounds(args, photos, work)
    table = render(args, photos, results, failures)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.md").write_text(table)
    (out / "peers.json").write_text(
        json.dumps(
            {
                "images": args.images,
                "rounds": args.rounds,
                "results": {f"{s}/{n}": v for (s, n), v in results.items()},
                "failures": {f"{s}/{n}": v for (s, n), v in failures.items()},
            },
            indent=1,
        )
    )
    from bench import peers_chart

    try:
        (out / "peers-summary.json").write_text(json.dumps(summary(args, results, failures), indent=1))
        print(
            "\nThe README's table (docs/peers.json: copy peers-summary.json there, then redraw docs/peers.png "
            "with bench/peers_chart.py):\n\n" + peers_chart.table(peers_chart.load(out / "peers-summary.json"))
        )
        peers_chart.draw(
            peers_chart.load(out / "peers-summary.json"),
            out / "peers.png",
            peers_chart.digest(out / "peers-summary.json"),
        )
    except Exception as e:  # a missing matplotlib (or a limit that failed) must not lose the table
        print(f"summary or chart failed: {e}", file=sys.stderr)
    print(
        f"wrote {out}/peers.md, peers.json, peers-summary.json, peers.png in {time.time() - start:.0f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
