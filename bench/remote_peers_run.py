"""`bench/remote.py --peers`: shardkit against its peers and a ceiling on one S3 server (moto, or
SeaweedFS with --server seaweedfs),
each condition a proxy of its own in front of it (tests/servers/latency_proxy.py, CONDITIONS below),
contestants interleaved (the order rotates each round), each epoch a fresh process
(bench/remote_peers.py says what each contestant does).

Per run: samples/s (images / seconds), first batch, the requests and bytes through the proxy (and
the resets and tails it dealt), shardkit's hedges and hedge wins (its stats() after the epoch),
the client's CPU seconds while its clock ran, and per GB that came through the proxy (its process
tree: DataLoader workers, CRT threads, curls; getrusage and /proc, measured in the process; the tree's whole life,
imports and exit included, is tree_cpu_s in the JSON, from getrusage(RUSAGE_CHILDREN) around the process), the
server's CPU seconds (it shares the machine's cores with the readers), and whether every sample
came exactly once. Then a fault run of shardkit's defaults.
Writes bench-out/remote-peers.{md,json,png} (remote-peers-seaweedfs.* with --server seaweedfs).

An untimed warm-up epoch of each contestant comes first (bytecode compiled, files in the page
cache), through a proxy that adds nothing; the fault run uses that proxy too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench import s3
from bench.remote_peers import CEILING, CONTESTANTS, CREDENTIALS, INSTALLED_AS, PEERS_VENV
from shardkit.bench.harness import error_bars, median, spread

REPO = Path(__file__).resolve().parent.parent
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
OUT = REPO / "bench-out"
PYCACHE = Path("/tmp/shardkit-bench-pycache")  # the venvs' bytecode, whichever way they were installed
RESET_MAX_BYTES = 1_000_000  # a reset response is cut after 0..1 MB: mid-body for a shard, a part or a range

CONDITIONS: dict[str, tuple[str, dict[str, float]]] = {  # key: (label, tests/servers/latency_proxy.py settings)
    "0ms": ("0 ms", {}),
    "100ms": ("+100 ms", {"latency_ms": 100}),
    "bw": ("50 ms, 20 MB/s a connection", {"latency_ms": 50, "conn_mbps": 20}),
    "tail": ("20 ms, 5% of requests at 1 s", {"latency_ms": 20, "tail_prob": 0.05, "tail_ms": 1000}),
    "reset": (
        "50 ms, 2% of responses reset",
        {"latency_ms": 50, "reset_prob": 0.02, "reset_max_bytes": RESET_MAX_BYTES},
    ),
}
PEERS = ("webdataset", "mosaic", "litdata", "s3torch")  # the other libraries, for "shardkit / best peer"


def pick(spec: str, table: dict, what: str) -> list[str]:
    """The keys of `table` that `spec` names (comma-separated keys or 0-based indices), in the
    table's order; all of them for an empty spec."""
    keys = list(table)
    if not spec.strip():
        return keys
    chosen = set()
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part.isdigit() and int(part) < len(keys):
            chosen.add(keys[int(part)])
        elif part in table:
            chosen.add(part)
        else:
            listed = ", ".join(f"{i} {k}" for i, k in enumerate(keys))
            raise ValueError(f"unknown {what} {part!r}; choose from: {listed}")
    return [k for k in keys if k in chosen]


def check_choices(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Resolve --conditions and --contestants into args.condition_keys and args.contestant_keys."""
    try:
        args.condition_keys = pick(args.conditions, CONDITIONS, "condition")
        args.contestant_keys = pick(args.contestants, CONTESTANTS, "contestant")
    except ValueError as e:
        ap.error(str(e))


def flags(settings: dict[str, float]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items()) or "nothing added"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    """CPU seconds of this process's children that have ended, theirs included (getrusage)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def install_failures() -> dict[str, str]:
    """Contestant key -> why scripts/peers_setup.sh could not install it."""
    if not PEERS_PYTHON.exists():
        return dict.fromkeys(PEERS_VENV, "not installed: .venv-peers missing (scripts/peers_setup.sh failed)")
    failed = REPO / ".venv-peers" / "failed.txt"
    lines = failed.read_text().splitlines() if failed.exists() else []
    reasons = {line.split(":", 1)[0]: line for line in lines if ":" in line}
    return {key: f"not installed: {reasons[dist]}" for key, dist in INSTALLED_AS.items() if dist in reasons}


def prepare(photos: Path, root: Path, names: list[str]) -> tuple[Path, dict[str, str]]:
    """The peers' venv and their copies of the images (made once, in .venv-peers); the keys of
    the contestants that cannot run, with why."""
    out = root / f"peers-{photos.name}"
    if not any(n in PEERS_VENV for n in names):
        return out, {}
    subprocess.run(["bash", str(REPO / "scripts" / "peers_setup.sh")], check=False)  # at once when already done
    missing = {k: v for k, v in install_failures().items() if k in names}
    own = [n for n in ("mosaic", "litdata") if n in names and n not in missing]
    if own and not (out / "lit" / "index.json").exists():
        done = subprocess.run(
            [str(PEERS_PYTHON), "-m", "bench.remote_peers", "prepare", str(photos), str(out)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            why = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
            missing.update(dict.fromkeys(own, f"preparing its copy failed: {why}"))
    return out, missing


def measure(
    key: str, endpoint: str, control: int, server_pid: int, timeout: float, images: int, trace: Path | None = None
) -> dict:
    """One epoch of `key` in a fresh process, through the proxy at `endpoint`; with `trace`, the
    proxy writes each of its requests there (a JSON line each, wall-clock times: the run's
    `began` is on the same clock)."""
    python = str(PEERS_PYTHON) if key in PEERS_VENV else sys.executable
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.unlink(missing_ok=True)
        s3.proxy_command(control, f"trace {trace}")
    before, server0, kids0 = json.loads(s3.proxy_command(control, "stats")), cpu_seconds(server_pid), children_cpu()
    env = {**os.environ, **CREDENTIALS, "PYTHONPATH": str(REPO), "PYTHONPYCACHEPREFIX": str(PYCACHE)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # imports from cached bytecode, as on a user's machine
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [python, "-m", "bench.remote_peers", "run", key, endpoint, s3.BUCKET],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    failed = None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout:.0f} s"
    finally:
        with contextlib.suppress(ProcessLookupError):  # its group: workers and curls it may have left
            os.killpg(proc.pid, signal.SIGKILL)
    if failed:
        out, err = proc.communicate()
    wall = time.perf_counter() - t0
    tree = children_cpu() - kids0
    if trace is not None:
        s3.proxy_command(control, "trace off")
    after = json.loads(s3.proxy_command(control, "stats"))
    res: dict = {k: after[k] - before[k] for k in ("requests", "bytes", "resets", "tailed", "throttled")}
    res.update(server_cpu_s=cpu_seconds(server_pid) - server0, wall_s=wall, tree_cpu_s=tree)
    if failed or proc.returncode:
        return {
            **res,
            "failed": failed or (err.strip().splitlines() or [f"exit {proc.returncode}, no output"])[-1][:200],
        }
    res.update(json.loads(out.strip().splitlines()[-1]))
    res["client_cpu_s"] = res["cpu_s"]  # the tree's while the clock ran (tree_cpu_s: its whole life, exit included)
    if key == CEILING:  # no samples of its own: every byte of every shard, or none
        res["samples"] = res["distinct"] = images if res["complete"] else 0
    return res


def rates(runs: list[dict]) -> list[float]:
    return [r["samples"] / r["seconds"] for r in runs]


def exact(run: dict, images: int) -> bool:
    return run["samples"] == run["distinct"] == images


def render(
    results: dict,
    failures: list[dict],
    skipped: dict[str, str],
    names: list[str],
    conds: list[str],
    images: int,
    rounds: int,
    shards: tuple[int, int],
    server: str = "moto",
) -> str:
    """The markdown report: samples/s, then one table for each other metric."""
    notes: list[str] = []  # footnotes: why a run failed, one a distinct reason

    def note(text: str) -> int:
        if text not in notes:
            notes.append(text)
        return notes.index(text) + 1

    def row_cells(key: str, fmt) -> list[str]:  # type: ignore[no-untyped-def]
        cells = []
        for c in conds:
            runs, fails = (
                results.get((key, c), []),
                [f for f in failures if (f["contestant"], f["condition"]) == (key, c)],
            )
            refs = ",".join(
                map(str, sorted({note(f"{CONTESTANTS[key]}, {CONDITIONS[c][0]}: {f['failed']}") for f in fails}))
            )
            if key in skipped:
                cells.append("-")
            elif not runs:
                cells.append(f"failed [{refs}]" if fails else "-")
            else:
                cells.append(
                    fmt(runs, key, c)
                    + (f" ({len(fails)} of {len(runs) + len(fails)} failed [{refs}])" if fails else "")
                )
        return cells

    def table(title: str, fmt, keys: list[str] | None = None, label=None) -> list[str]:  # type: ignore[no-untyped-def]
        lines = [f"| {title} | " + " | ".join(CONDITIONS[c][0] for c in conds) + " |", "|---" * (len(conds) + 1) + "|"]
        for key in keys if keys is not None else names:
            lines.append(f"| {label(key) if label else CONTESTANTS[key]} | " + " | ".join(row_cells(key, fmt)) + " |")
        return lines + [""]

    def med(runs: list[dict], field: str) -> float:
        return median(r[field] for r in runs)

    def ratio_row(title: str, against: tuple[str, ...], percent: bool) -> str | None:
        """shardkit's median samples/s over the best median of `against`, a cell a condition."""
        cells = []
        for c in conds:
            mine, theirs = results.get(("shardkit", c)), [results[(k, c)] for k in against if results.get((k, c))]
            if not (mine and theirs):
                cells.append("-")
                continue
            value = median(rates(mine)) / max(median(rates(t)) for t in theirs)
            cells.append(f"{value:.0%}" if percent else f"{value:.2f}x")
        return f"| *{title}* | " + " | ".join(cells) + " |" if set(cells) != {"-"} else None

    size, count = shards
    lines = [
        f"{images:,} images ({size / 1e6:.0f} MB in {count} tar shards), {rounds} interleaved round(s), each epoch "
        f"a fresh process, DataLoader(num_workers=2, batch_size=64), raw bytes, shuffled, fresh caches; {server} on "
        "loopback behind tests/servers/latency_proxy.py; median (min-max) over rounds.",
        "",
        "Conditions (proxy settings): "
        + "; ".join(f"{CONDITIONS[c][0]} (`{c}`: {flags(CONDITIONS[c][1])})" for c in conds)
        + ".",
        "",
    ]
    lines += table("samples/s", lambda runs, k, c: spread(rates(runs)))
    extra = [
        r
        for r in (
            ratio_row("shardkit, % of the ceiling", (CEILING,), True),
            ratio_row("shardkit / best peer", PEERS, False),
        )
        if r
    ]
    if extra:
        lines = lines[:-1] + extra + [""]
    lines += table("first batch s", lambda runs, k, c: "-" if k == CEILING else spread([r["first_s"] for r in runs], 2))

    def traffic(runs: list[dict], k: str, c: str) -> str:
        text = f"{med(runs, 'requests'):,.0f} / {med(runs, 'bytes') / 1e6:,.0f}"
        faults = [
            f"{what}: {med(runs, f):,.0f}"
            for f, what in (("resets", "resets"), ("tailed", "in the tail"))
            if med(runs, f)
        ]
        return text + (f" ({', '.join(faults)})" if faults else "")

    lines += table("requests / MB through the proxy, an epoch", traffic)
    lines += table(
        f"client CPU s (process tree) / {server} CPU s, an epoch",
        lambda runs, k, c: f"{med(runs, 'client_cpu_s'):.1f} / {med(runs, 'server_cpu_s'):.1f}",
    )
    lines += table(
        "client CPU s per GB through the proxy",
        lambda runs, k, c: spread([r["client_cpu_s"] / (r["bytes"] / 1e9) for r in runs if r["bytes"]], 1),
    )

    def hedges(runs: list[dict], k: str, c: str) -> str:
        stats = [r.get("stats", {}) for r in runs]
        if not all("hedges" in s for s in stats):
            return "not in stats()"
        wins = f" / {median(s['hedge_wins'] for s in stats):,.0f}" if all("hedge_wins" in s for s in stats) else ""
        return f"{median(s['hedges'] for s in stats):,.0f}{wins}"

    def store(key: str) -> str:
        found = {r.get("stats", {}).get("store") for c in conds for r in results.get((key, c), [])} - {None}
        return CONTESTANTS[key] + (f" (store: {', '.join(sorted(found))})" if found else "")

    shardkits = [k for k in names if k.startswith("shardkit")]
    if shardkits:
        lines += table("hedges / hedge wins, an epoch (stats())", hedges, shardkits, store)
    lines += table(
        "every sample exactly once",
        lambda runs, k, c: (
            "yes"
            if all(exact(r, images) for r in runs)
            else f"NO ({sum(not exact(r, images) for r in runs)} of {len(runs)})"
        ),
    )
    lines = lines[:-1]
    if skipped:
        lines += [""] + [f"- {CONTESTANTS[k]}: {why}" for k, why in skipped.items()]
    if notes:
        lines += [""] + [f"[{i}] {text}" for i, text in enumerate(notes, 1)]
    return "\n".join(lines)


def chart(path: Path, results: dict, names: list[str], conds: list[str], images: int, server: str) -> None:
    """Grouped bars: a group a condition, a bar a contestant (only those with results), min-max
    as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = [c for c in conds if any(results.get((n, c)) for n in names)]
    names = [n for n in names if any(results.get((n, c)) for c in conds)]
    if not conds:
        return
    colors = dict(zip([n for n in CONTESTANTS if n != CEILING], plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.0 + 1.6 * len(conds) * max(1, len(names)) / 5), 5))
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        xs, series = [], []
        for i, c in enumerate(conds):
            if runs := results.get((n, c)):
                xs.append(i + (j - (len(names) - 1) / 2) * width)
                series.append(rates(runs))
        meds, whiskers = error_bars(series)
        style = {"color": "0.75", "hatch": "//", "edgecolor": "0.4"} if n == CEILING else {"color": colors.get(n)}
        ax.bar(xs, meds, width, yerr=whiskers, capsize=2, label=CONTESTANTS[n], **style)
    ax.set_xticks(range(len(conds)), [textwrap.fill(CONDITIONS[c][0], 16) for c in conds], fontsize=8)
    ax.set_ylabel("samples/s (median, min-max)")
    ax.set_title(
        f"One epoch from S3 ({server} on loopback behind a proxy), {images:,} images,\n"
        "DataLoader(num_workers=2, batch_size=64), raw bytes",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fault_run(url: str, endpoint: str, control: int, images: int) -> str:
    """shardkit's defaults with 5% of responses reset and a 10 s storm of 503s on 20% of GETs."""
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    ds = StreamingDataset(url, storage_options=s3.options(endpoint), shuffle=True)
    before = json.loads(s3.proxy_command(control, "stats"))
    s3.proxy_command(control, "set reset_prob 0.05")
    s3.proxy_command(control, "storm 10 0.2")
    start = time.perf_counter()
    keys = [k for batch in DataLoader(ds, batch_size=64, num_workers=2) for k in batch["__key__"]]
    took = time.perf_counter() - start
    s3.proxy_command(control, "set reset_prob 0")
    after = json.loads(s3.proxy_command(control, "stats"))
    stats = ds.stats()
    once = len(keys) == len(set(keys)) == images
    return (
        f"fault run (shardkit defaults, +0 ms, 5% of responses reset, a 10 s storm of 503 SlowDown on 20% of "
        f"GETs): {after['resets'] - before['resets']} resets, {after['throttled'] - before['throttled']} "
        f"throttled answers, stats()['throttled'] = {stats['throttled']}, {len(keys)} samples, every one exactly "
        f"once: {once}, {len(keys) / took:,.0f} samples/s"
    )


def command_line(args: argparse.Namespace) -> str:
    line = f"python -m bench.remote --peers --images {args.images} --rounds {args.rounds}"
    if args.conditions:
        line += f" --conditions {','.join(args.condition_keys)}"
    if args.contestants:
        line += f" --contestants {','.join(args.contestant_keys)}"
    if args.server != "moto":
        line += f" --server {args.server}"
    return line


def main(args: argparse.Namespace, photos: Path, shards: Path) -> None:
    began = time.perf_counter()
    conds, names = args.condition_keys, args.contestant_keys
    peers, skipped = prepare(photos, Path(args.dir), names)
    for key, why in skipped.items():
        print(f"{CONTESTANTS[key]}: skipped, {why}", file=sys.stderr)
    names = [n for n in names if n not in skipped]
    server, endpoint = s3.start_server(args.server, Path(args.dir))
    procs = [server]
    try:
        fs = s3.bucket_fs(endpoint)
        fs.put(str(shards), f"{s3.BUCKET}/shardkit", recursive=True)
        for key, folder in (("mosaic", "mds"), ("litdata", "lit")):
            if key in names:
                fs.put(str(peers / folder), f"{s3.BUCKET}/{folder}", recursive=True)
        from shardkit import index

        url, opts = f"s3://{s3.BUCKET}/shardkit", s3.options(endpoint)
        index.save(index.pinned(index.load(url, opts), url, opts), url, opts)  # the versions in this bucket
        proxies = {}
        for c in ("plain", *conds):  # plain: the warm-up and the fault run
            proc, purl, control = s3.start_proxy(endpoint, **(CONDITIONS[c][1] if c in CONDITIONS else {}))
            procs.append(proc)
            proxies[c] = (purl, control)
        results: dict[tuple[str, str], list[dict]] = {}
        failures: list[dict] = []
        runs: list[dict] = []
        for name in names:  # untimed: every contestant's bytecode compiled and its files in the page cache
            res = measure(name, *proxies["plain"], server.proc.pid, args.timeout, args.images)
            if "failed" in res:
                print(f"warm-up {name}: FAILED {res['failed']}", file=sys.stderr)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)] if names else []
            for c in conds:
                for name in order:
                    trace = OUT / "traces" / f"{r + 1}-{c}-{name}.jsonl" if args.trace else None
                    res = measure(name, *proxies[c], server.proc.pid, args.timeout, args.images, trace)
                    runs.append({"contestant": name, "condition": c, "round": r + 1, **res})
                    if "failed" in res:
                        failures.append(runs[-1])
                        print(f"round {r + 1} {c} {name}: FAILED {res['failed']}", file=sys.stderr)
                        continue
                    results.setdefault((name, c), []).append(res)
                    first = "-" if res["first_s"] is None else f"{res['first_s']:.2f} s"
                    print(
                        f"round {r + 1} {c} {name}: {res['samples'] / res['seconds']:,.0f} samples/s, first {first}, "
                        f"{res['requests']} requests, {res['client_cpu_s']:.1f} CPU s",
                        file=sys.stderr,
                    )
        tars = list(shards.glob("*.tar"))
        table = render(
            results,
            failures,
            skipped,
            names + list(skipped),
            conds,
            args.images,
            args.rounds,
            (sum(p.stat().st_size for p in tars), len(tars)),
            args.server,
        )
        fault = fault_run(url, *proxies["plain"], args.images) if "shardkit" in names else ""
        OUT.mkdir(exist_ok=True)
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        took = time.perf_counter() - began
        text = f"{stamp}, `{command_line(args)}` ({took / 60:.1f} min)\n\n{table}\n" + (f"\n{fault}\n" if fault else "")
        name = "remote-peers" + ("" if args.server == "moto" else f"-{args.server}")
        (OUT / f"{name}.md").write_text(text)
        doc = {
            "date": stamp,
            "command": command_line(args),
            "server": args.server,
            "images": args.images,
            "rounds": args.rounds,
            "shards": len(tars),
            "conditions": {c: {"label": CONDITIONS[c][0], "proxy": CONDITIONS[c][1]} for c in conds},
            "contestants": {n: CONTESTANTS[n] for n in names},
            "skipped": skipped,
            "runs": runs,
            "fault_run": fault,
            "seconds": took,
        }
        (OUT / f"{name}.json").write_text(json.dumps(doc, indent=1))
        chart(OUT / f"{name}.png", results, names, conds, args.images, args.server)
        print(text)
    finally:
        for p in procs:
            s3.stop(p)
