"""`bench_remote.py --peers`: shardkit against its peers on one S3 server (moto), through one
delaying proxy per latency, contestants interleaved (the order rotates each round), each
epoch a fresh process (scripts/remote_peers.py). Per run: samples/s, first batch, the
requests and bytes the proxy saw, its resets and throttled answers, and moto's CPU seconds
(moto shares the machine's cores with the readers: a design that is cheap for moto is not
necessarily cheap for S3, and the reverse). Then a fault run of shardkit's defaults.
Writes bench-out/remote-peers.{md,json,png}."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_remote as bench
from remote_peers import CREDENTIALS, LOADERS, PEERS_VENV

REPO = bench.HERE.parent
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
LATENCIES = (0, 100)
OUT = REPO / "bench-out"
PYCACHE = Path("/tmp/shardkit-bench-pycache")  # the venvs' bytecode, whichever way they were installed


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prepare(photos: Path, root: Path) -> Path:
    """The peers' copies of the images (made once, in .venv-peers)."""
    out = root / f"peers-{photos.name}"
    if not (out / "lit" / "index.json").exists():
        subprocess.run(["bash", str(bench.HERE / "peers_setup.sh")], check=True)
        subprocess.run([str(PEERS_PYTHON), str(bench.HERE / "remote_peers.py"), "prepare", str(photos), str(out)],
                       check=True)
    return out


def measure(name: str, endpoint: str, control: int, moto_pid: int, timeout: float) -> dict:
    python = str(PEERS_PYTHON) if name in PEERS_VENV else sys.executable
    before, cpu = json.loads(bench.proxy_command(control, "stats")), cpu_seconds(moto_pid)
    env = {**os.environ, **CREDENTIALS, "PYTHONPATH": str(REPO), "PYTHONPYCACHEPREFIX": str(PYCACHE)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # imports from cached bytecode, as on a user's machine
    t0 = time.perf_counter()
    done = subprocess.run([python, str(bench.HERE / "remote_peers.py"), "run", name, endpoint, bench.BUCKET],
                          capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    after = json.loads(bench.proxy_command(control, "stats"))
    if done.returncode:
        return {"failed": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    res = json.loads(done.stdout.strip().splitlines()[-1])
    res.update({k: after[k] - before[k] for k in ("requests", "bytes", "resets", "throttled")},
               moto_cpu_s=cpu_seconds(moto_pid) - cpu, wall_s=wall)
    return res


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def rates(runs: list[dict]) -> list[float]:
    return [r["samples"] / r["seconds"] for r in runs]


def render(results: dict, failures: dict, images: int, rounds: int, total: int) -> str:
    lines = [f"{images:,} images ({total / 1e6:.0f} MB of shards), {rounds} interleaved rounds, "
             f"DataLoader(num_workers=2, batch_size=64), raw bytes, shuffled; median (min-max)", "",
             "| contestant | 0 ms: samples/s | +100 ms: samples/s (% of own 0 ms) | first batch 0 / +100 ms | "
             "requests an epoch | MB an epoch | moto CPU s an epoch | exact |", "|---|---|---|---|---|---|---|---|"]
    for name in LOADERS:
        cells = [name]
        runs = {ms: results.get((name, ms), []) for ms in LATENCIES}
        if not all(runs.values()):
            lines.append(f"| {name} | {failures.get(name, 'failed')} |  |  |  |  |  |  |")
            continue
        r0, r100 = rates(runs[0]), rates(runs[100])
        cells.append(f"{statistics.median(r0):,.0f} ({min(r0):,.0f}-{max(r0):,.0f})")
        cells.append(f"{statistics.median(r100):,.0f} ({min(r100):,.0f}-{max(r100):,.0f}) "
                     f"({statistics.median(r100) / statistics.median(r0):.0%})")
        cells.append(f"{med(runs[0], 'first_s'):.2f} / {med(runs[100], 'first_s'):.2f} s")
        cells.append(f"{med(runs[0], 'requests'):.0f}")
        cells.append(f"{med(runs[0], 'bytes') / 1e6:.0f}")
        cells.append(f"{med(runs[0], 'moto_cpu_s'):.2f} / {med(runs[100], 'moto_cpu_s'):.2f}")
        exact = all(r["samples"] == r["distinct"] == images for rs in runs.values() for r in rs)
        cells.append("yes" if exact else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(path: Path, results: dict, images: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in LOADERS if all(results.get((n, ms)) for ms in LATENCIES)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.38
    for k, ms in enumerate(LATENCIES):
        meds = [statistics.median(rates(results[(n, ms)])) for n in names]
        err = [[m - min(rates(results[(n, ms)])) for n, m in zip(names, meds)],
               [max(rates(results[(n, ms)])) - m for n, m in zip(names, meds)]]
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        ax.bar(xs, meds, width, yerr=err, capsize=3, label=f"+{ms} ms first-byte latency",
               color=("#1f77b4", "#ff7f0e")[k])
    ax.set_xticks(range(len(names)), [n.replace(", ", ",\n").replace(" (", "\n(") for n in names], fontsize=8)
    ax.set_ylabel("samples/s (median, min-max)")
    ax.set_title(f"One epoch from S3 (moto on loopback + delaying proxy), {images:,} images, "
                 "DataLoader(num_workers=2, batch_size=64), raw", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fault_run(url: str, endpoint: str, control: int, images: int) -> str:
    """shardkit's defaults with 5% of responses reset and a 10 s storm of 503s on 20% of GETs."""
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    ds = StreamingDataset(url, storage_options=bench.options(endpoint), shuffle=True)
    before = json.loads(bench.proxy_command(control, "stats"))
    bench.proxy_command(control, "set reset_prob 0.05")
    bench.proxy_command(control, "storm 10 0.2")
    start = time.perf_counter()
    keys = [k for batch in DataLoader(ds, batch_size=64, num_workers=2) for k in batch["__key__"]]
    took = time.perf_counter() - start
    bench.proxy_command(control, "set reset_prob 0")
    after = json.loads(bench.proxy_command(control, "stats"))
    stats = ds.stats()
    exact = len(keys) == len(set(keys)) == images
    return (f"fault run (shardkit defaults, +0 ms, 5% of responses reset, a 10 s storm of 503 SlowDown on 20% of "
            f"GETs): {after['resets'] - before['resets']} resets, {after['throttled'] - before['throttled']} "
            f"throttled answers, stats()['throttled'] = {stats['throttled']}, {len(keys)} samples, every one exactly "
            f"once: {exact}, {len(keys) / took:,.0f} samples/s")


def main(args: argparse.Namespace, photos: Path, shards: Path) -> None:
    import fsspec.core

    peers = prepare(photos, Path(args.dir))
    moto, endpoint = bench.start_moto()
    procs = [moto]
    try:
        fs, _ = fsspec.core.url_to_fs(f"s3://{bench.BUCKET}", **bench.options(endpoint))
        fs.mkdir(bench.BUCKET)
        for local, name in ((shards, "shardkit"), (peers / "mds", "mds"), (peers / "lit", "lit")):
            fs.put(str(local), f"{bench.BUCKET}/{name}", recursive=True)
        from shardkit import index

        url, opts = f"s3://{bench.BUCKET}/shardkit", bench.options(endpoint)
        index.save(index.pinned(index.load(url, opts), url, opts), url, opts)  # the versions in this bucket
        proxies = {}
        for ms in LATENCIES:
            proc, purl, control = bench.start_proxy(endpoint, ms)
            procs.append(proc)
            proxies[ms] = (purl, control)
        results: dict[tuple[str, int], list[dict]] = {}
        failures: dict[str, str] = {}
        for name in LOADERS:  # untimed: every contestant's bytecode compiled and its files in the page cache
            measure(name, proxies[0][0], proxies[0][1], moto.pid, args.timeout)
        for r in range(args.rounds):
            names = list(LOADERS)
            names = names[r % len(names):] + names[: r % len(names)]
            for ms in LATENCIES:
                for name in names:
                    res = measure(name, proxies[ms][0], proxies[ms][1], moto.pid, args.timeout)
                    if "failed" in res:
                        failures[name] = f"failed: {res['failed']}"
                        print(f"round {r + 1} +{ms} ms {name}: FAILED {res['failed']}", file=sys.stderr)
                        continue
                    results.setdefault((name, ms), []).append(res)
                    print(f"round {r + 1} +{ms} ms {name}: {res['samples'] / res['seconds']:,.0f} samples/s, first "
                          f"{res['first_s']:.2f} s, {res['requests']} requests", file=sys.stderr)
        total = sum(p.stat().st_size for p in shards.glob("*.tar"))
        table = render(results, failures, args.images, args.rounds, total)
        fault = fault_run(url, proxies[0][0], proxies[0][1], args.images)
        OUT.mkdir(exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        text = f"{stamp}, `python scripts/bench_remote.py --peers --images {args.images} --rounds {args.rounds}`\n\n" \
               f"{table}\n\n{fault}\n"
        (OUT / "remote-peers.md").write_text(text)
        (OUT / "remote-peers.json").write_text(json.dumps({f"{n} +{ms}": v for (n, ms), v in results.items()}, indent=1))
        chart(OUT / "remote-peers.png", results, args.images)
        print(text)
    finally:
        for p in procs:
            p.terminate()
            p.wait(5)
