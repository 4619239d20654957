"""`shardkit bench`: how fast StreamingDataset feeds a DataLoader, over the values of one setting.

For each value of the varied setting (``num_workers`` or the dataset's ``prefetch`` depth)
`run_bench` builds the dataset and the loader, warms up, times K passes of N batches and
reports images/s, MB/s, the time to the first batch and the peak memory of the main process
and its workers. The command line only parses options and prints `report.format_report`.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ShardkitError
from ..storage import StorageOptions
from .harness import mean_std
from .memory import PeakRss
from .transforms import ResizeTransform, Transform

if TYPE_CHECKING:
    from ..reading.dataset import StreamingDataset

WITHIN = 0.05  # the recommendation: the smallest setting within 5% of the best mean


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
    mean, std = mean_std(rates)
    mb_mean, mb_std = mean_std(mb)
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
