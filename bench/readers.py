"""The local readers the reading benchmarks share (bench/read.py, cold.py, decode.py,
peers.py): their common per-image work (`decode_resize`), the plain-files baseline (`Files`)
and one adapter a contestant, run by name in a process of its own (`run_contestant`), every
clock started after one full garbage collection (`start_clock`)."""

from __future__ import annotations

import gc
import io
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from shardkit.bench.harness import spread


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


def fast_transform(backend: str = "auto"):  # type: ignore[no-untyped-def]
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


def loader_pass(loader) -> tuple[float, float, int, float]:  # type: ignore[no-untyped-def]
    start, cpu = start_clock(), cpu_seconds()
    first = None
    n = 0
    for images, _ in loader:
        if first is None:
            first = time.perf_counter() - start
        n += len(images)
    # the iterator, run out, has shut down its workers and waited for them: their CPU time counts
    return first or 0.0, time.perf_counter() - start, n, cpu_seconds() - cpu


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have exited (DataLoader workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_contestant(name: str, shards: str, photos: str) -> dict:
    """One measurement of contestant `name` (a key of ADAPTERS) in this process."""
    import torch.utils.data  # noqa: F401 - every contestant's process has torch loaded, as a training script would

    if name not in ADAPTERS:
        raise SystemExit(f"unknown contestant {name}")
    return ADAPTERS[name](name, shards, photos)


def _limit(name: str, shards: str, photos: str) -> dict:
    """A limit: its per-image work alone on WORKERS processes, the photos in memory first."""
    import multiprocessing as mp

    files = [str(p) for p in sorted(Path(photos).rglob("*.jpg"))]
    halves = [(name, files[i::WORKERS]) for i in range(WORKERS)]
    with mp.get_context("fork").Pool(WORKERS) as pool:
        blobs = pool.map(_read_all, halves)  # bytes in memory before the clock starts
        del blobs
        start = start_clock()
        counts = pool.map(_decode_all, halves)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "items": sum(n for n, _ in counts), "cpu": sum(c for _, c in counts), "first": None}


def _cat(name: str, shards: str, photos: str) -> dict:
    start = start_clock()
    subprocess.run(f"cat {shards}/*.tar > /dev/null", shell=True, check=True)
    size = sum(p.stat().st_size for p in Path(shards).glob("*.tar"))
    return {"seconds": time.perf_counter() - start, "items": sample_count(shards), "bytes": size, "first": None}


def _pread_members(name: str, shards: str, photos: str) -> dict:
    """One pread per tar member into a fresh bytes, every offset known in advance."""
    import tarfile

    members = []
    for url in shard_urls(shards):
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
        "items": sample_count(shards),
        "bytes": shard_bytes(shards),
        "first": None,
    }


def _shardkit_raw(name: str, shards: str, photos: str) -> dict:
    from shardkit import StreamingDataset

    start = start_clock()
    n = size = 0
    for sample in StreamingDataset(shards):
        n += 1
        size += len(sample["jpg"]) + len(sample["json"])
    return {"seconds": time.perf_counter() - start, "items": n, "bytes": shard_bytes(shards), "first": None}


def _webdataset_raw(name: str, shards: str, photos: str) -> dict:
    import webdataset as wds

    start = start_clock()
    n = 0
    for _ in wds.WebDataset(shard_urls(shards), shardshuffle=False, empty_check=False):
        n += 1
    return {"seconds": time.perf_counter() - start, "items": n, "bytes": shard_bytes(shards), "first": None}


def _in_a_loader(build: Callable[[str, str, str], Any]) -> Callable[[str, str, str], dict]:
    """The adapter of a contestant that is a DataLoader: `build` makes it, one pass is timed."""

    def run(name: str, shards: str, photos: str) -> dict:
        first, seconds, n, cpu = loader_pass(build(name, shards, photos))
        return {"seconds": seconds, "items": n, "cpu": cpu, "first": first}

    return run


def _shardkit_loader(name: str, shards: str, photos: str) -> Any:
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    if name == BATCHED:
        ds = StreamingDataset(shards, shuffle=True, transform=shardkit_transform, batch_size=BATCH)
        return DataLoader(ds, batch_size=None, num_workers=WORKERS)
    ds = StreamingDataset(shards, shuffle=True, transform=shardkit_transform)
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _lmdb_loader(name: str, shards: str, photos: str) -> Any:
    from torch.utils.data import DataLoader

    import shardkit

    ds = shardkit.LMDBDataset(shards + ".lmdb", transform=shardkit_transform)
    collate = shardkit.collate if name == LMDB_FAST else None
    return DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS, collate_fn=collate)


def _tar_map_loader(name: str, shards: str, photos: str) -> Any:
    from torch.utils.data import DataLoader

    import shardkit

    ds = shardkit.TarDataset(shards, transform=shardkit_transform)
    return DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=WORKERS)


def _files_loader(name: str, shards: str, photos: str) -> Any:
    from torch.utils.data import DataLoader

    import shardkit

    collate = shardkit.collate if name == FILES_FAST else None
    return DataLoader(Files(photos), batch_size=BATCH, shuffle=True, num_workers=WORKERS, collate_fn=collate)


def _fast_loader(name: str, shards: str, photos: str) -> Any:
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    batched = name == FAST_BATCHED
    ds = StreamingDataset(
        shards, shuffle=True, decode="raw", transform=fast_transform(), batch_size=BATCH if batched else None
    )
    return DataLoader(ds, batch_size=None if batched else BATCH, num_workers=WORKERS)


def _main_process_loader(name: str, shards: str, photos: str) -> Any:
    from torch.utils.data import DataLoader

    from shardkit import StreamingDataset

    fast = name == MAIN_FAST
    ds = StreamingDataset(
        shards, shuffle=True, decode="raw", transform=fast_transform() if fast else shardkit_transform
    )
    import shardkit  # torch's threads as the process has them

    return DataLoader(ds, batch_size=BATCH, num_workers=0, collate_fn=shardkit.collate)


def _webdataset_loader(name: str, shards: str, photos: str) -> Any:
    import webdataset as wds
    from torch.utils.data import DataLoader

    ds = wds.WebDataset(shard_urls(shards), shardshuffle=100, empty_check=False).shuffle(1000).map(wds_transform)
    return DataLoader(ds, batch_size=BATCH, num_workers=WORKERS)


def _shuffled(name: str, shards: str, photos: str) -> dict:
    """Every sample once, in a shuffled order, undecoded (`cls` and `json` aside)."""
    import shardkit

    order = np.random.default_rng(0).permutation(sample_count(shards)).tolist()
    if name == RANDOM_FLOOR:
        idx = shardkit.index.with_offsets(shardkit.index.load(shards))  # the sidecar's (index version 2)
        spans = [
            (os.path.join(shards, s.name), a, b)
            for s in idx.shards
            for a, b in zip(s.offsets.tolist(), s.offsets.tolist()[1:])
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
    transform = fast_transform(backend)
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

# a contestant's name -> its adapter (name, shards, photos) -> one measurement
ADAPTERS: dict[str, Callable[[str, str, str], dict]] = {
    **dict.fromkeys(LIMITS, _limit),
    "cat (limit)": _cat,
    PREAD_FLOOR: _pread_members,
    **dict.fromkeys(RANDOM, _shuffled),
    "shardkit raw": _shardkit_raw,
    "webdataset raw": _webdataset_raw,
    **dict.fromkeys(["shardkit", BATCHED], _in_a_loader(_shardkit_loader)),
    **dict.fromkeys(["LMDB random access", LMDB_FAST], _in_a_loader(_lmdb_loader)),
    TAR_MAP: _in_a_loader(_tar_map_loader),
    **dict.fromkeys(["plain files", FILES_FAST], _in_a_loader(_files_loader)),
    **dict.fromkeys([FAST, FAST_BATCHED], _in_a_loader(_fast_loader)),
    **dict.fromkeys([MAIN_PIL, MAIN_FAST], _in_a_loader(_main_process_loader)),
    "webdataset": _in_a_loader(_webdataset_loader),
}


def shard_urls(shards: str) -> list[str]:
    return [str(p) for p in sorted(Path(shards).glob("*.tar"))]


def shard_bytes(shards: str) -> int:
    return sum(p.stat().st_size for p in Path(shards).glob("*.tar"))


def sample_count(shards: str) -> int:
    return json.loads((Path(shards) / "index.json").read_text())["samples"]


def ranged(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """'median (min-max)' of a contestant's rounds, the range shown for one round too."""
    return spread(values, digits, scale, range_of_one=True)
