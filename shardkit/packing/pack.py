"""Pack an ImageFolder tree (or convert a shardkit dataset) into tar shards or an LMDB:
plan -> jobs -> write -> commit.

- plan (plan.py): scan SRC once (by the input kind that claims it: inputs/), sort,
  optionally shuffle with a seed, cut into shards by count and size. Every shard is an independent job with a fingerprint of its inputs.
- read (jobs.py): each job's samples, read, checked and optionally re-encoded.
- write and commit (commit.py, with sinks/tar.py or sinks/lmdb.py): the one resume/commit
  mechanism; index.json is written last, and a rerun after a crash keeps every job whose
  record matches its fingerprint, so it ends with exactly what an uninterrupted run makes.
"""

from __future__ import annotations


import os
from collections.abc import Sequence
from typing import Any

from .. import checks, storage
from ..errors import SourceError, shown_name
from ..formats import DEFAULT
from ..index import Index
from ..storage import StorageOptions
from . import commit, executors, sinks
from .commit import Sink
from .plan import DEFAULT_MAX_FILE_SIZE, DEFAULT_MAX_SIZE, Options, Plan, make_plan
from .inputs.folder import HIDDEN, LAYOUTS


def pack(
    src: str,
    dest: str,
    *,
    format: str = DEFAULT,
    max_count: int | None = None,
    max_size: int | str | None = DEFAULT_MAX_SIZE,
    workers: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    on_error: str = "skip",
    resize: int | None = None,
    quality: int | None = None,
    decode_check: bool = False,
    progress: bool | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    storage_options: StorageOptions | None = None,
    overwrite: bool = False,
    stats: dict[str, int] | None = None,
    layout: str = "classes",
    fields: Sequence[str] = (),
    max_file_size: int | str | None = DEFAULT_MAX_FILE_SIZE,
) -> Index:
    """Pack the ImageFolder tree `src` (or the images a `.csv` / `.jsonl` manifest lists, or
    convert the shardkit dataset at `src`) into tar shards or an LMDB (`format`), with
    index.json, under `dest`.

    An image's sidecars (`photo.txt`, `photo.json`, `photo.cls`, `photo.seg.png`, and any
    extension `fields` names) become fields of its sample; `layout="flat"` takes images
    anywhere under `src`, without classes (see the Sample layouts guide).

    Deterministic: the same input and options give the same samples in the same order (and,
    for tar, byte-identical shards), whatever `workers` is. Safe to rerun after a crash:
    finished work is kept, the rest is written. Returns the committed Index
    (`index.skipped` lists every input that was left out).

    Args:
        src: an ImageFolder tree (`SRC/<class>/<image>`), a folder of images (`layout="flat"`),
            a `.csv` or `.jsonl` manifest, or a tar or LMDB dataset to convert; a local path or
            a URL.
        dest: the folder or URL prefix the dataset goes in (LMDB: a local path). It is locked
            for the pack (`DEST/.shardkit-lock`: a file locked with flock locally, an object
            created conditionally and held by a lease on S3, GCS and Azure): a second pack into
            it raises DestinationBusyError at once, naming the first. Other remote stores
            (WebHDFS, HDFS) are not locked: one pack at a time.
        format: ``"tar"`` (WebDataset shards) or ``"lmdb"``.
        max_count: the most samples a shard holds.
        max_size: the most bytes a shard holds (``"256MB"`` or an int; None: no limit).
        workers: processes that write shards (default: the CPU count); the cores no shard
            keeps busy (fewer shards than workers, or a pack's last shards) take on the
            re-encoding or decode check of the shards still going.
        shuffle: shuffle the samples across shards (with `seed`) rather than keep sorted order.
        seed: the shuffle's seed.
        on_error: ``"skip"`` leaves an unusable file out and lists it; ``"raise"`` stops the pack
            (``"fail"``, its old name, still works, with a DeprecationWarning).
        resize: re-encode each image with its shorter side at most this many pixels.
        quality: the JPEG quality of re-encoded images (default 90 with `resize`).
        decode_check: decode every image in full, as a reader's decoder would (a slower pack),
            so a corrupt image whose ends look right is skipped and listed at pack time.
        progress: show a progress bar (default: when stderr is a terminal).
        executor: ``"local"`` (a process pool) or ``"ray"`` (the same jobs as Ray tasks; inputs
            and outputs must be reachable from every node).
        ray_address: the Ray cluster to join (default: Ray's own lookup).
        storage_options: passed to fsspec unchanged, for a remote `src` or `dest`.
        overwrite: replace a finished dataset made from another source or with other options.
        stats: a dict to fill with `kept` (source files an earlier run finished), `written`
            (source files this run packed) and `unchanged` (1 when DEST held this very pack).
        layout: ``"classes"`` (images in class folders) or ``"flat"`` (images anywhere, no class).
        fields: sidecar extensions besides ``txt``, ``json``, ``cls`` and ``seg.png``
            (``("depth.png", "npy")``): `photo.depth.png` becomes the field `depth.png` of
            `photo.jpg`'s sample.
        max_file_size: the most bytes of a source image file (``"1GiB"`` or an int, the default;
            None: no limit); a larger one is skipped (or stops the pack under ``on_error="raise"``)
            by its listed size, before it is read.
    """
    src, dest = checks.path("src", src), checks.path("dest", dest)
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', not {executor!r}")
    sink_type = sinks.sink_for(format)
    seed, shuffle, overwrite = (
        checks.integer("seed", seed),
        checks.flag("shuffle", shuffle),
        checks.flag("overwrite", overwrite),
    )
    storage_options = checks.mapping("storage_options", storage_options)
    on_error = checks.on_error(on_error)
    max_count, workers = checks.optional("max_count", max_count, 1), checks.optional("workers", workers, 1)
    resize, quality = checks.optional("resize", resize, 1), checks.optional("quality", quality, 1, 100)
    max_size = sink_type.job_limit(checks.size("max_size", max_size, 1) if max_size is not None else None)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'classes' or 'flat', not {layout!r}")
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats must be a dict to fill (or None), not {stats!r}")
    _check_dest(src, dest, sink_type.local_only, format)
    max_file_size = checks.size("max_file_size", max_file_size, 1) if max_file_size is not None else None
    options = Options(
        resize=resize,
        quality=quality,
        on_error=on_error,
        decode_check=checks.flag("decode_check", decode_check),
        max_file_size=max_file_size,
    )
    plan = _planned(
        src,
        dest,
        sink_type,
        options,
        storage_options,
        max_count=max_count,
        max_size=max_size,
        shuffle=shuffle,
        seed=seed,
        layout=layout,
        fields=fields,
    )
    runner = _runner(executor, ray_address, workers, dest)
    sink = sink_type(plan, dest, storage_options)
    tally = stats if stats is not None else {}
    tally.update(kept=len(plan.order), written=0, unchanged=1)  # what a finished pack's rerun reports
    return commit.run(plan, sink, runner, progress, overwrite, tally)


def _check_dest(src: str, dest: str, local_only: bool, fmt: str) -> None:
    """Refuse a DEST the pack cannot write: remote for a local-only format, SRC or inside it, a file."""
    if local_only and not storage.is_local(dest):
        raise SourceError(f"{storage.display(dest)}: {fmt.upper()} output must be a local path (copy it up afterwards)")
    _check_apart(src, dest)
    if storage.is_local(dest) and os.path.exists(there := storage.local_path(dest)) and not os.path.isdir(there):
        raise SourceError(f"{dest}: a file, not a folder (DEST is the folder the dataset goes in)")  # or a device


def _planned(
    src: str,
    dest: str,
    sink_type: type[Sink],
    options: Options,
    storage_options: StorageOptions,
    *,
    max_count: int | None,
    max_size: int | None,
    shuffle: bool,
    seed: int,
    layout: str,
    fields: Sequence[str],
) -> Plan:
    """The pack's plan; under on_error="raise", the first unusable input stops it here, before any write."""
    plan = make_plan(
        src,
        dest,
        max_count=max_count,
        max_size=max_size,
        shuffle=shuffle,
        seed=seed,
        options=options,
        fmt=sink_type.name,
        job_name=sink_type.job_name,
        payload=sink_type.payload,
        storage_options=storage_options,
        layout=layout,
        fields=fields,
    )
    unusable = [s for s in plan.skipped if s.reason != HIDDEN]
    if options.on_error == "raise" and unusable:
        raise SourceError(f"{shown_name(storage.join(plan.src, unusable[0].path))}: {unusable[0].reason}")
    return plan


def _runner(executor: str, ray_address: str | None, workers: int | None, dest: str) -> executors.Runner[Any, Any]:
    """Where the jobs run: Ray tasks, or a local process pool (a process a core by default)."""
    if executor == "ray":
        return executors.ray(ray_address, sizes=lambda job: len(job.items))
    return executors.local(workers or os.cpu_count() or 1, uploading=not storage.is_local(dest))


def _check_apart(src: str, dest: str) -> None:
    """Refuse a DEST that is SRC or inside it: the pack would read what it writes (a rerun
    would even pack the shards as a class of images)."""
    if storage.is_local(src) != storage.is_local(dest):
        return
    if storage.is_local(src):
        s, d = (os.path.realpath(storage.local_path(u)) for u in (src, dest))
    else:
        s, d = src.rstrip("/"), dest.rstrip("/")
    if d == s or d.startswith(s.rstrip("/") + "/"):
        where = "is the source" if d == s else f"is inside the source {src}"
        raise SourceError(f"{dest}: the destination {where}: pack into a folder outside it")
