"""Pack an ImageFolder tree into shards: plan -> jobs -> write -> commit.

- plan: scan SRC once, sort, optionally shuffle with a seed, cut into shards by count and
  size. The plan is plain data; every shard is an independent job with a fingerprint of its
  inputs.
- write: a job writes its shard under a temporary name and renames it into place when
  complete, then drops a small progress record beside it.
- commit: index.json is written last. A rerun after a crash reuses every shard whose
  progress record matches its fingerprint and size, so it ends with exactly the bytes an
  uninterrupted run makes.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from json.encoder import encode_basestring as _json_str  # type: ignore[attr-defined]
from typing import NamedTuple

import numpy as np

from . import images, index, storage
from .errors import SourceError
from .formats.tar import BLOCK, TarWriter
from .index import Index, ShardInfo, Skipped
from .storage import StorageOptions
from .units import parse_size

PROGRESS_DIR = ".shardkit-progress"
SHARD_NAME = "shard-{:06d}.tar"
_SHARD_RE = re.compile(r"^shard-\d{6,}\.tar$")
DEFAULT_MAX_SIZE = "256MB"


@dataclass(frozen=True)
class Options:
    """What shapes the bytes of a shard (part of every job's fingerprint)."""

    resize: int | None = None
    quality: int | None = None
    on_error: str = "skip"


class Item(NamedTuple):
    key: str
    path: str  # relative to SRC, '/'-separated
    label: int
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Job:
    name: str
    src: str
    dest: str
    items: tuple[Item, ...]
    classes: tuple[str, ...]
    options: Options
    fingerprint: str
    storage_options: StorageOptions | None = None


@dataclass(frozen=True)
class Plan:
    classes: tuple[str, ...]
    jobs: tuple[Job, ...]
    skipped: tuple[Skipped, ...]
    fingerprint: str


@dataclass(frozen=True)
class ShardResult:
    info: ShardInfo
    fields: tuple[str, ...]
    skipped: tuple[Skipped, ...]


# ---------------------------------------------------------------- plan


def _walk(top: str, rel: str, seen: set[tuple[int, int]], skipped: list[Skipped]) -> Iterator[tuple[str, os.stat_result]]:
    """Yield (relpath, stat) of files under `top`, following symlinks but never a loop."""
    try:
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in seen:
            skipped.append(Skipped(rel + "/", "symlink loop (folder already visited)"))
            return
        seen.add((st.st_dev, st.st_ino))
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as e:
        skipped.append(Skipped(rel + "/", f"cannot list folder ({e.strerror or e})"))
        return
    for entry in entries:
        child = f"{rel}/{entry.name}"
        try:
            if entry.is_dir():
                yield from _walk(entry.path, child, seen, skipped)
            elif entry.is_file():
                yield child, entry.stat()
            elif entry.is_symlink():
                skipped.append(Skipped(child, "broken symlink"))
            else:
                skipped.append(Skipped(child, "not a regular file"))
        except OSError as e:
            skipped.append(Skipped(child, f"cannot stat ({e.strerror or e})"))


def scan(src: str) -> tuple[tuple[str, ...], list[Item], list[Skipped]]:
    """Classes (sorted folder names), items without keys yet, and what was left out."""
    path = storage.local_path(src)
    if not os.path.exists(path):
        raise SourceError(f"{src}: no such folder")
    if not os.path.isdir(path):
        raise SourceError(f"{src}: not a folder (expected SRC/<class>/<image>)")
    skipped: list[Skipped] = []
    classes = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name.startswith("."):
            skipped.append(Skipped(entry.name, "hidden entry ignored"))
        elif entry.is_dir():
            classes.append(entry.name)
        else:
            skipped.append(Skipped(entry.name, "not inside a class folder"))
    if not classes:
        raise SourceError(f"{src}: no class folders (expected SRC/<class>/<image>)")
    items: list[Item] = []
    seen: set[tuple[int, int]] = set()
    for label, name in enumerate(classes):
        for rel, st in _walk(os.path.join(path, name), name, seen, skipped):
            if images.field_for(rel) is None:
                skipped.append(Skipped(rel, "not an image file extension"))
                continue
            items.append(Item("", rel, label, st.st_size, st.st_mtime_ns))
    if not items:
        raise SourceError(f"{src}: no image files in {len(classes)} class folders")
    return tuple(classes), items, skipped


def _meta(item: Item, classes: tuple[str, ...]) -> bytes:
    """`{"class":...,"path":...}`: compact, keys sorted, UTF-8 (what json.dumps would give)."""
    return f'{{"class":{_json_str(classes[item.label])},"path":{_json_str(item.path)}}}'.encode()


def _member_bytes(n: int) -> int:
    return BLOCK + n + (-n % BLOCK)


def _fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def make_plan(
    src: str,
    dest: str,
    *,
    max_count: int | None = None,
    max_size: int | str | None = DEFAULT_MAX_SIZE,
    shuffle: bool = True,
    seed: int = 0,
    options: Options = Options(),
    storage_options: StorageOptions | None = None,
) -> Plan:
    classes, items, skipped = scan(src)
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(items))
        items = [items[i] for i in order]
    width = max(6, len(str(len(items) - 1)))
    limit = parse_size(max_size) if max_size is not None else None
    groups: list[list[Item]] = [[]]
    size = 0
    for number, item in enumerate(items):
        item = item._replace(key=f"{number:0{width}d}")
        # exact for copied bytes: image, cls and json members with their headers
        need = _member_bytes(item.size) + _member_bytes(len(str(item.label))) + _member_bytes(len(_meta(item, classes)))
        full = (max_count is not None and len(groups[-1]) >= max_count) or (
            limit is not None and size + need > limit
        )
        if groups[-1] and full:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += need
    jobs = []
    for i, group in enumerate(groups):
        name = SHARD_NAME.format(i)
        fp = _fingerprint(name, classes, asdict(options), group)
        jobs.append(Job(name, src, dest, tuple(group), classes, options, fp, storage_options))
    plan_fp = _fingerprint("tar", classes, [j.fingerprint for j in jobs])
    return Plan(classes, tuple(jobs), tuple(skipped), plan_fp)


# ---------------------------------------------------------------- write

_counter = None  # multiprocessing.Value shared with pool workers, for the progress bar


def _init_worker(counter) -> None:  # type: ignore[no-untyped-def]
    global _counter
    _counter = counter


def _tick(n: int) -> None:
    if _counter is not None and n:
        with _counter.get_lock():
            _counter.value += n


def _sample_fields(job: Job, item: Item) -> dict[str, bytes]:
    data = storage.read_bytes(storage.join(job.src, item.path), job.storage_options)
    opts = job.options
    if opts.resize or opts.quality:
        field, data = "jpg", images.reencode(data, opts.resize, opts.quality or 90)
    else:
        field = images.check(data, images.field_for(item.path) or "")
    return {field: data, "cls": str(item.label).encode(), "json": _meta(item, job.classes)}


def write_shard(job: Job) -> ShardResult:
    """Write one shard atomically; bad files are skipped (or raise under on_error='fail')."""
    skipped: list[Skipped] = []
    fields: set[str] = set()
    pending = 0
    with storage.atomic_writer(storage.join(job.dest, job.name), job.storage_options) as f:
        writer = TarWriter(f)
        for item in job.items:
            try:
                sample = _sample_fields(job, item)
            except (OSError, images.BadImage) as e:
                reason = str(e) if isinstance(e, images.BadImage) else f"cannot read ({e.strerror or e})"
                if job.options.on_error == "fail":
                    raise SourceError(f"{storage.join(job.src, item.path)}: {reason}") from None
                skipped.append(Skipped(item.path, reason))
            else:
                writer.write(item.key, sample)
                fields.update(sample)
            pending += 1
            if pending >= 32:
                _tick(pending)
                pending = 0
        sha = writer.close()
    _tick(pending)
    info = ShardInfo(job.name, len(writer.offsets) - 1, writer.size, sha, tuple(writer.offsets))
    result = ShardResult(info, tuple(sorted(fields)), tuple(skipped))
    record = {"fingerprint": job.fingerprint, "shard": info.to_json(), "fields": result.fields,
              "skipped": [asdict(s) for s in skipped]}
    storage.write_bytes_atomic(_progress_url(job), json.dumps(record).encode(), job.storage_options)
    return result


def _progress_url(job: Job) -> str:
    return storage.join(job.dest, PROGRESS_DIR, job.name + ".json")


def _done(job: Job) -> ShardResult | None:
    """The result of an earlier run of this exact job, if its shard is complete and unchanged."""
    try:
        record = json.loads(storage.read_bytes(_progress_url(job), job.storage_options))
    except (FileNotFoundError, ValueError):
        return None
    if record.get("fingerprint") != job.fingerprint:
        return None
    info = ShardInfo.from_json(record["shard"])
    if storage.size(storage.join(job.dest, job.name), job.storage_options) != info.bytes:
        return None
    return ShardResult(info, tuple(record["fields"]), tuple(Skipped(**s) for s in record["skipped"]))


# ---------------------------------------------------------------- run


def _prepare_dest(dest: str, plan: Plan, storage_options: StorageOptions | None) -> Index | None:
    """Check DEST holds nothing but shardkit's own files; clear leftovers. Returns an index
    already committed for this very plan, if any."""
    names = storage.listdir(dest, storage_options)
    foreign = [n for n in names if not (n in (index.INDEX_NAME, PROGRESS_DIR) or _SHARD_RE.match(n) or storage.TMP_MARK in n)]
    if foreign:
        raise SourceError(f"{dest}: destination is not empty and not a shardkit dataset (found {foreign[0]!r})")
    for name in names:
        if storage.TMP_MARK in name:
            storage.remove(storage.join(dest, name), storage_options)
    if index.INDEX_NAME in names:
        try:
            existing = index.load(dest, storage_options)
        except (OSError, ValueError):
            existing = None
        if existing is not None and existing.plan == plan.fingerprint:
            sizes_ok = all(storage.size(storage.join(dest, s.name), storage_options) == s.bytes for s in existing.shards)
            if sizes_ok:
                return existing
        # an older dataset is being replaced: readers must not see a mix of old and new shards
        storage.remove(storage.join(dest, index.INDEX_NAME), storage_options)
    storage.makedirs(storage.join(dest, PROGRESS_DIR), storage_options)
    return None


def _run_jobs(jobs: list[Job], workers: int, on_done: Callable[[ShardResult], None],
              on_progress: Callable[[int], None]) -> None:
    """Run jobs on a process pool (inline for one worker); report images done so far."""
    counter = multiprocessing.Value("q", 0)
    if workers <= 1 or len(jobs) <= 1:
        _init_worker(counter)
        try:
            for job in jobs:
                on_done(write_shard(job))
                on_progress(counter.value)
        finally:
            _init_worker(None)
        return
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), initializer=_init_worker, initargs=(counter,)) as pool:
        futures = {pool.submit(write_shard, job) for job in jobs}
        try:
            while futures:
                done, futures = wait(futures, timeout=0.2, return_when=FIRST_EXCEPTION)
                for fut in done:
                    on_done(fut.result())
                on_progress(counter.value)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise


def pack(
    src: str,
    dest: str,
    *,
    format: str = "tar",
    max_count: int | None = None,
    max_size: int | str | None = DEFAULT_MAX_SIZE,
    workers: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    on_error: str = "skip",
    resize: int | None = None,
    quality: int | None = None,
    progress: bool | None = None,
    storage_options: StorageOptions | None = None,
) -> Index:
    """Pack the ImageFolder tree `src` into shards plus index.json under `dest`.

    Deterministic: the same input and options give byte-identical output, whatever `workers`
    is. Safe to rerun after a crash: finished shards are kept, the rest are written.
    Returns the committed Index (`index.skipped` lists every file that was left out).
    """
    if format != "tar":
        raise SourceError(f"unknown format {format!r} (supported: tar)")
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', not {on_error!r}")
    options = Options(resize=resize, quality=quality, on_error=on_error)
    plan = make_plan(src, dest, max_count=max_count, max_size=max_size, shuffle=shuffle, seed=seed,
                     options=options, storage_options=storage_options)
    if on_error == "fail" and plan.skipped:
        s = plan.skipped[0]
        raise SourceError(f"{storage.join(src, s.path)}: {s.reason}")
    storage.makedirs(dest, storage_options)
    committed = _prepare_dest(dest, plan, storage_options)
    if committed is not None:
        return committed

    results: dict[str, ShardResult] = {}
    todo = []
    for job in plan.jobs:
        done = _done(job)
        if done is None:
            todo.append(job)
        else:
            results[job.name] = done

    from tqdm import tqdm

    total = sum(len(j.items) for j in plan.jobs)
    initial = total - sum(len(j.items) for j in todo)
    show = progress if progress is not None else sys.stderr.isatty()
    with tqdm(total=total, initial=initial, unit="img", disable=not show, desc="pack", smoothing=0.1) as bar:
        _run_jobs(todo, workers or os.cpu_count() or 1,
                  on_done=lambda r: results.__setitem__(r.info.name, r),
                  on_progress=lambda n: bar.update(initial + n - bar.n))

    ordered = [results[j.name] for j in plan.jobs]
    skipped = sorted([*plan.skipped, *(s for r in ordered for s in r.skipped)], key=lambda s: s.path)
    idx = Index(
        shards=tuple(r.info for r in ordered),
        kind="tar",
        fields=tuple(sorted({f for r in ordered for f in r.fields})),
        classes=plan.classes,
        skipped=tuple(skipped),
        plan=plan.fingerprint,
    )
    index.save(idx, dest, storage_options)
    _cleanup(dest, plan, storage_options)
    return idx


def _cleanup(dest: str, plan: Plan, storage_options: StorageOptions | None) -> None:
    """After commit: drop progress records and shards of an earlier, different plan."""
    wanted = {j.name for j in plan.jobs}
    for name in storage.listdir(storage.join(dest, PROGRESS_DIR), storage_options):
        storage.remove(storage.join(dest, PROGRESS_DIR, name), storage_options)
    storage.remove_dir(storage.join(dest, PROGRESS_DIR), storage_options)
    for name in storage.listdir(dest, storage_options):
        if _SHARD_RE.match(name) and name not in wanted:
            storage.remove(storage.join(dest, name), storage_options)
