"""`shardkit bench`: how fast StreamingDataset feeds a DataLoader, over the values of one setting.

For each value of the varied setting (``num_workers`` or the dataset's ``prefetch`` depth)
`run_bench` builds the dataset and the loader, warms up, times K passes of N batches and
reports images/s, MB/s, the time to the first batch and the peak memory of the main process
and its workers. The command line only parses options and prints `format_report`.

Also here, shared with `shardkit preview`: `Transform`, a user function named
``module:function`` or ``path/to/file.py:function`` that pickles by name.
"""

from __future__ import annotations

import gc
import hashlib
import importlib
import importlib.util
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..decode import image_field, to_rgb
from ..errors import FieldError, ShardkitError, describe
from ..storage import StorageOptions

if TYPE_CHECKING:
    from ..reading.dataset import StreamingDataset

WITHIN = 0.05  # the recommendation: the smallest setting within 5% of the best mean
IMAGE_SIZE = 224  # the default transform resizes every image to this square, so batches collate
SETTINGS = ("num_workers", "prefetch")


# ------------------------------------------------------------------ transforms


def load_function(spec: str) -> Callable[..., Any]:
    """The function named by ``module:function`` or ``path/to/file.py:function``.
    Raises ValueError with a one-line message naming what could not be found."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{spec!r}: expected module:function or path/to/file.py:function")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"{module_name}: no such file")
        key = f"_shardkit_user_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]}"
        module = sys.modules.get(key)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(key, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ValueError(f"{module_name}: not a Python file")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[key] = module  # so classes and pickles defined there resolve
            try:
                loader_spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[key]
                raise ValueError(f"{module_name}: {type(e).__name__}: {e}") from None
    else:
        try:
            module = _import(module_name)
        except ModuleNotFoundError as e:
            raise ValueError(f"cannot import module {module_name!r}: {e}") from None
        except Exception as e:  # the module's own code failed
            raise ValueError(f"module {module_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{module_name} has no function {name!r}")
    return cast(Callable[..., Any], fn)


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        # the console script does not put the working directory on sys.path, `python -m` does
        cwd = os.getcwd()
        if e.name is None or not name.startswith(e.name) or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(name)


class TransformError(ShardkitError):
    """The user's --transform raised."""


class Transform:
    """A user's sample transform named by ``module:function``: loaded (and so checked) now,
    pickled by name, so it reaches DataLoader workers under spawn as well as fork."""

    def __init__(self, spec: str):
        module_name, _, name = spec.rpartition(":")
        if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
            spec = f"{Path(module_name).resolve()}:{name}"  # workers may start elsewhere
        self.spec = spec
        self.fn = load_function(spec)

    def __call__(self, sample: Any) -> Any:
        try:
            return self.fn(sample)
        except FieldError:
            raise  # bad data it found (image_transform decoding the image): the reader names or skips it
        except Exception as e:  # noqa: BLE001 - the user's code: named, with the sample, in one line
            key = sample.get("__key__") if isinstance(sample, dict) else None
            raise TransformError(f"--transform {self.spec} failed on sample {key}: {describe(e)}") from e

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec}

    def __setstate__(self, state: dict[str, Any]) -> None:
        Transform.__init__(self, state["spec"])

    def __repr__(self) -> str:
        return self.spec


def to_chw(image: Any) -> Any:
    """A CHW uint8 torch tensor from a tensor (CHW), an HWC numpy array or a PIL image."""
    import torch

    if isinstance(image, torch.Tensor):
        return image
    if not isinstance(image, np.ndarray):  # PIL
        image = np.asarray(to_rgb(image))
    if image.ndim == 2:
        image = image[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))


class ResizeTransform:
    """The default bench transform: sample -> (its first image as a CHW uint8 tensor resized
    to `size` x `size`, cls), so batches of differently sized images collate. With
    ``decode="raw"`` it returns (number of image bytes, cls): reading alone is measured."""

    def __init__(self, size: int = IMAGE_SIZE):
        self.size = size

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, int]:
        import torch
        import torch.nn.functional as F

        key = image_field(sample)
        if key is None:
            raise TransformError(f"sample {sample.get('__key__')} has no image field (give --transform)")
        label = int(sample.get("cls", -1))
        image = sample[key]
        if isinstance(image, (bytes, bytearray, memoryview)):
            return len(image), label
        chw = to_chw(image)
        if tuple(chw.shape[-2:]) != (self.size, self.size):
            resized = F.interpolate(
                chw[None].float(), size=(self.size, self.size), mode="bilinear", align_corners=False
            )
            chw = resized[0].round_().clamp_(0, 255).to(torch.uint8)
        return chw, label

    def __repr__(self) -> str:
        return f"default: first image resized to {self.size}x{self.size} (its byte count with decode raw), cls"


# ------------------------------------------------------------------ memory


def rss(pid: int) -> int:
    """Resident set size of a process in bytes (0 when it is gone, or without /proc)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def in_use(pid: int) -> int:
    """Anonymous and shared memory of a process in bytes, each page divided among the processes
    that map it (/proc/PID/smaps_rollup's Pss_Anon + Pss_Shmem): summed over a process tree,
    every page it maps counts once, and no page cache. 0 when it is gone, or without /proc."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Pss_Anon:", b"Pss_Shmem:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        pass
    return total


class PeakRss:
    """Samples the memory of process `pid` (default: this one) and its descendants (DataLoader
    workers) every `interval` seconds from a thread; keeps the peaks. Linux only: elsewhere
    peaks stay None. `peak_total` sums VmRSS: a copy-on-write page shared by several processes
    counts in each, so it is an upper bound. `peak_in_use` sums `in_use`: each page the tree
    maps once, page cache not counted, and nothing else the machine runs."""

    def __init__(self, interval: float = 0.05, pid: int | None = None):
        self.interval = interval
        self.pid = os.getpid() if pid is None else pid
        self.available = os.path.exists(f"/proc/{self.pid}/status")
        self.peak_main: int | None = None
        self.peak_total: int | None = None
        self.peak_in_use: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        if not self.available:
            return
        tree, todo = [self.pid], _children(self.pid)
        while todo:
            pid = todo.pop()
            if pid not in tree:
                tree.append(pid)
                todo.extend(_children(pid))
        main = rss(self.pid)
        self.peak_main = max(self.peak_main or 0, main)
        self.peak_total = max(self.peak_total or 0, main + sum(rss(pid) for pid in tree[1:]))
        self.peak_in_use = max(self.peak_in_use or 0, sum(in_use(pid) for pid in tree))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def start(self) -> None:
        self.sample()
        if self.available:
            self._thread = threading.Thread(target=self._run, name="shardkit-bench-rss", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()


# ------------------------------------------------------------------ measuring


def _batch_len(batch: Any) -> int:
    """Samples in a collated batch: the length of its first field (a tensor, or the list
    that default_collate makes of strings)."""
    while True:
        if isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        elif (
            isinstance(batch, (list, tuple))
            and batch
            and (hasattr(batch[0], "shape") or isinstance(batch[0], (list, tuple, dict)))
        ):
            batch = batch[0]  # the fields of a collated tuple
        else:
            break
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else 1
    return len(batch) if isinstance(batch, (list, tuple)) else 1


def _next(loader: Any, it: Any) -> tuple[Any, Any]:
    """The next batch; an epoch shorter than a pass goes on with the next epoch."""
    try:
        return next(it), it
    except StopIteration:
        it = iter(loader)
        try:
            return next(it), it
        except StopIteration:
            raise ShardkitError("the dataset yields no samples") from None


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def bench_setting(
    url: str | Sequence[str],
    *,
    num_workers: int,
    prefetch: int,
    batch_size: int,
    decode: str,
    transform: Callable[[dict[str, Any]], Any],
    batches: int,
    passes: int,
    warmup: int,
    storage_options: StorageOptions | None = None,
    on_error: str = "raise",
) -> dict[str, Any]:
    """Measure one setting: warm-up (the first batch timed from a cold start), then `passes`
    passes of `batches` batches, each from a fresh iterator of the same loader."""
    import torch

    gc.collect()  # else the process's first full collection after importing torch (~0.15 s) lands in a first batch
    start = time.perf_counter()  # the first batch counts building the dataset too (a remote index.json)
    ds, loader = _loader(
        url,
        num_workers=num_workers,
        prefetch=prefetch,
        batch_size=batch_size,
        decode=decode,
        transform=transform,
        storage_options=storage_options,
        on_error=on_error,
    )
    memory = PeakRss()
    threads = torch.get_num_threads()
    if not num_workers:  # one torch thread, as DataLoader gives each worker: settings differ in processes only
        torch.set_num_threads(1)  # (torch's threads on a busy machine made num_workers=0 look 7x slower)
    try:
        first_batch_s, rates = _passes(loader, memory, start, warmup=warmup, passes=passes, batches=batches)
        del loader  # shuts the workers down
        gc.collect()  # a pass left unfinished in this process flushes its counters when collected
    finally:
        memory.stop()
        torch.set_num_threads(threads)
    return _summary(
        ds,
        rates,
        memory,
        num_workers=num_workers,
        prefetch=prefetch,
        batch_size=batch_size,
        first_batch_s=first_batch_s,
    )


def _loader(
    url: str | Sequence[str],
    *,
    num_workers: int,
    prefetch: int,
    batch_size: int,
    decode: str,
    transform: Callable[[dict[str, Any]], Any],
    storage_options: StorageOptions | None,
    on_error: str,
) -> tuple[StreamingDataset, Any]:
    """(dataset, DataLoader) as the README recommends training: batches made in the workers."""
    from torch.utils.data import DataLoader

    from ..reading.dataset import StreamingDataset

    ds = StreamingDataset(
        url,
        shuffle=True,
        decode=decode,
        transform=transform,
        prefetch=prefetch,
        storage_options=storage_options,
        batch_size=batch_size,
        on_error=on_error,
    )
    return ds, DataLoader(ds, batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0)


def _passes(
    loader: Any, memory: PeakRss, start: float, *, warmup: int, passes: int, batches: int
) -> tuple[float, list[float]]:
    """(seconds from `start` to the first batch, images/s of each pass): `warmup` batches, then
    `passes` passes of `batches` batches, each from a fresh iterator of `loader`."""
    it = iter(loader)  # starts the workers
    memory.start()  # after the fork: no thread is running while workers start
    _, it = _next(loader, it)
    first_batch_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        _, it = _next(loader, it)
    rates: list[float] = []
    for _ in range(passes):
        # a fresh pass; with persistent workers iter() first collects the batches the
        # workers made ahead for the previous iterator, so the clock starts after it
        it = iter(loader)
        start, images = time.perf_counter(), 0
        for _ in range(batches):
            batch, it = _next(loader, it)
            images += _batch_len(batch)
        rates.append(images / (time.perf_counter() - start))
    return first_batch_s, rates


def _summary(
    ds: StreamingDataset,
    rates: list[float],
    memory: PeakRss,
    *,
    num_workers: int,
    prefetch: int,
    batch_size: int,
    first_batch_s: float,
) -> dict[str, Any]:
    """One setting's figures: images/s and MB/s per pass with mean and spread, memory, counters."""
    stats = ds.stats()
    if stats["samples"]:
        per_sample = stats["bytes"] / stats["samples"]
    else:  # no counter flushed yet (workers flush every few hundred samples): the index's average
        per_sample = ds.index.bytes / max(ds.index.samples, 1)
    # the counters are flushed every few hundred samples, so per-pass byte deltas are coarse;
    # MB/s is each pass's images/s times the bytes per sample the counters measured overall
    mb = [r * per_sample / 1e6 for r in rates]
    mean, std = _mean_std(rates)
    mb_mean, mb_std = _mean_std(mb)
    return {
        "num_workers": num_workers,
        "prefetch": prefetch,
        "images_per_s": rates,
        "mean_images_per_s": mean,
        "std_images_per_s": std,
        "mb_per_s": mb,
        "mean_mb_per_s": mb_mean,
        "std_mb_per_s": mb_std,
        "first_batch_s": first_batch_s,
        "batch_ms": 1000 * batch_size / mean if mean else float("inf"),
        "peak_rss_bytes": memory.peak_total,
        "peak_main_rss_bytes": memory.peak_main,
        "bytes_per_sample": per_sample,
        "stats": {
            k: stats[k]
            for k in ("samples", "bytes", "read_s", "decode_s", "transform_s", "skipped", "fetched_bytes", "cache_hits")
        },
    }


def recommend(settings: Sequence[dict[str, Any]], varied: str) -> dict[str, Any]:
    """The smallest value of the varied setting within WITHIN of the best mean images/s."""
    ordered = sorted(settings, key=lambda s: s[varied])
    best = max(s["mean_images_per_s"] for s in ordered)
    pick = next(s for s in ordered if s["mean_images_per_s"] >= (1 - WITHIN) * best)
    text = f"{varied}={pick[varied]} ({pick['mean_images_per_s']:.0f} images/s)"
    if len(ordered) == 1:
        text += ": the only setting tested"
    elif pick is ordered[-1]:
        text += ": the fastest tested, more may help"
    elif best > pick["mean_images_per_s"]:
        text += f": more adds under {WITHIN:.0%}"
    else:
        text += ": more is no faster"
    return {varied: pick[varied], "mean_images_per_s": pick["mean_images_per_s"], "text": text}


def run_bench(
    url: str | Sequence[str],
    *,
    workers: Sequence[int] = (0, 1, 2),
    prefetch: Sequence[int] = (8,),
    batch_size: int = 64,
    decode: str = "tensor",
    transform: str | Callable[[dict[str, Any]], Any] | None = None,
    batches: int = 50,
    passes: int = 3,
    warmup: int = 5,
    step_ms: float | None = None,
    storage_options: StorageOptions | None = None,
    on_error: str = "raise",
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Benchmark StreamingDataset under a DataLoader for each value of `workers` or of
    `prefetch` (at most one of them may hold several values). `transform` is a callable,
    a ``module:function`` name, or None for `ResizeTransform`. `on_error` is the dataset's
    ("raise" or "skip": bad samples counted in each setting's stats). Returns a JSON-ready
    dict; `progress` is called with each setting's result as it is done."""
    workers, prefetch = list(workers), list(prefetch)
    if not workers or not prefetch:
        raise ValueError("workers and prefetch need at least one value each")
    if len(workers) > 1 and len(prefetch) > 1:
        raise ValueError("vary one setting at a time: several values for workers or for prefetch, not both")
    if min(batch_size, batches, passes, warmup) < 1:
        raise ValueError("batch_size, batches, passes and warmup must be at least 1")
    varied = "prefetch" if len(prefetch) > 1 else "num_workers"
    fn = Transform(transform) if isinstance(transform, str) else transform or ResizeTransform()
    settings = []
    for w in workers:
        for p in prefetch:
            result = bench_setting(
                url,
                num_workers=w,
                prefetch=p,
                batch_size=batch_size,
                decode=decode,
                transform=fn,
                batches=batches,
                passes=passes,
                warmup=warmup,
                storage_options=storage_options,
                on_error=on_error,
            )
            if step_ms is not None:
                result["data_bound"] = result["batch_ms"] > step_ms
            if progress is not None:
                progress(result)
            settings.append(result)
    return {
        "url": url if isinstance(url, str) else list(url),
        "varied": varied,
        "batch_size": batch_size,
        "decode": decode,
        "transform": repr(fn)
        if isinstance(fn, (Transform, ResizeTransform))
        else getattr(fn, "__qualname__", repr(fn)),
        "batches": batches,
        "passes": passes,
        "warmup": warmup,
        "step_ms": step_ms,
        "cpus": os.cpu_count(),
        "settings": settings,
        "recommendation": recommend(settings, varied),
    }


# ------------------------------------------------------------------ reporting


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def format_report(doc: dict[str, Any]) -> str:
    """The table, the data-bound verdicts (with step_ms) and the recommendation line."""
    head = ("num_workers", "prefetch", "images/s", "MB/s", "first batch", "peak RSS (workers)")
    rows = [head]
    for s in doc["settings"]:
        rows.append(
            (
                str(s["num_workers"]),
                str(s["prefetch"]),
                f"{s['mean_images_per_s']:.0f} ± {s['std_images_per_s']:.0f}",
                f"{s['mean_mb_per_s']:.1f} ± {s['std_mb_per_s']:.1f}",
                f"{s['first_batch_s']:.2f} s",
                f"{_mib(s['peak_rss_bytes'])} ({_mib(_minus(s['peak_rss_bytes'], s['peak_main_rss_bytes']))})",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        f"{doc['url']}: batch size {doc['batch_size']}, decode {doc['decode']}, transform {doc['transform']}; "
        f"{doc['passes']} pass{'es' * (doc['passes'] != 1)} of {doc['batches']} batch{'es' * (doc['batches'] != 1)} "
        f"after {doc['warmup']} warm-up batch{'es' * (doc['warmup'] != 1)}"
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    step = doc.get("step_ms")
    if step is not None:
        for s in doc["settings"]:
            name = f"{doc['varied']}={s[doc['varied']]}"
            relation = ">" if s["data_bound"] else "<="
            line = f"{name}: {s['batch_ms']:.1f} ms per batch {relation} {step:g} ms step: "
            if s["data_bound"]:
                line += "data-bound"
            elif s["num_workers"] == 0:  # loading runs in the training process, between steps
                line += f"not data-bound, but without workers each step also waits {s['batch_ms']:.1f} ms for its batch"
            else:
                line += "keeps up"
            lines.append(line)
    skipped = max(s["stats"]["skipped"] for s in doc["settings"])
    if skipped:
        lines.append(f"skipped bad samples: up to {skipped:.0f} per setting (replaced, so batches stay full)")
    lines.append(f"recommendation: {doc['recommendation']['text']}")
    return "\n".join(lines)


def _minus(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def write_plot(doc: dict[str, Any], path: str) -> None:
    """An error-bar chart of images/s (mean ± std over passes) against the varied setting."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ShardkitError("--plot needs matplotlib: pip install matplotlib") from None
    varied, settings = doc["varied"], sorted(doc["settings"], key=lambda s: s[doc["varied"]])
    fig = Figure(figsize=(6, 4), dpi=100)
    FigureCanvasAgg(fig)  # Agg, without pyplot's global state
    ax = fig.add_subplot()
    xs = list(range(len(settings)))
    ax.errorbar(
        xs,
        [s["mean_images_per_s"] for s in settings],
        yerr=[s["std_images_per_s"] for s in settings],
        fmt="o-",
        capsize=4,
    )
    ax.set_xticks(xs, [str(s[varied]) for s in settings])
    ax.set_xlabel(varied)
    ax.set_ylabel("images/s (mean ± std over passes)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"batch size {doc['batch_size']}, decode {doc['decode']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    ext = os.path.splitext(path)[1].lower().lstrip(".")  # b.jpg a JPEG, as preview writes; anything else a PNG
    fig.savefig(path, format=ext if ext in fig.canvas.get_supported_filetypes() else "png")
