"""Pack an ImageFolder tree (or convert a shardkit dataset) into tar shards or an LMDB:
plan -> jobs -> write -> commit.

- plan (plan.py): scan SRC once, sort, optionally shuffle with a seed, cut into shards by
  count and size. Every shard is an independent job with a fingerprint of its inputs.
- write: a job drops any earlier progress record of its shard, writes the shard under a
  temporary name, renames it into place when complete, then records its progress.
- commit: index.json is written last. A rerun after a crash reuses every shard whose
  progress record matches its fingerprint and size, so it ends with exactly the bytes an
  uninterrupted run makes.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import checks, index, storage
from . import executors, images
from ..errors import CorruptShardError, SourceError, about_the_file, name_file
from .executors import tick
from ..formats import lmdb as lmdb_format
from ..formats.tar import RECORD, TarWriter
from ..index import Index, ShardInfo, Skipped
from .items import DAMAGED, read_item
from .plan import DEFAULT_MAX_SIZE, Job, JobList, Options, Plan, make_plan
from .scan import HIDDEN, LAYOUTS, source_kind
from ..sources import local_lmdb
from ..storage import StorageOptions
from ..units import parse_size

_SHARD_RE = re.compile(r"^shard-\d{6,}\.tar$")
_TMP_RE = re.compile(rf"^(shard-\d{{6,}}\.tar|{re.escape(index.INDEX_NAME)}){re.escape(storage.TMP_MARK)}[0-9a-f]{{12}}$")
"""What an interrupted pack leaves: a shard's or the index's temporary file (storage.atomic_writer's names)."""
_STARTED = "started"  # in the progress folder, written first: even an object store then shows the pack unfinished
LMDB_JOB = parse_size("64MB")  # an LMDB pack's most bytes per job (one transaction, held in memory)
_LMDB_FILES = (index.INDEX_NAME, lmdb_format.DATA_FILE, lmdb_format.LOCK_FILE)  # removal order: the index first


@dataclass(frozen=True)
class ShardResult:
    info: ShardInfo
    fields: tuple[str, ...]
    skipped: tuple[Skipped, ...]


@dataclass(frozen=True)
class ChunkResult:
    """A job's samples, read and checked in a worker, for the one LMDB writer."""

    name: str
    samples: tuple[tuple[str, dict[str, bytes]], ...]
    skipped: tuple[Skipped, ...]


# ---------------------------------------------------------------- write

def _samples(job: Job, check: Callable[[str, dict[str, bytes]], None] | None = None
             ) -> Iterator[tuple[str, dict[str, bytes]] | Skipped]:
    """The job's samples in order; unusable ones (by `check` too) as Skipped (or SourceError
    under on_error='fail')."""
    pending = 0
    for item in job.items:
        executors.stop_point()
        try:
            sample = read_item(job, item)
            if check is not None:
                check(*sample)
            yield sample
        except (OSError, images.BadImage, CorruptShardError) as e:
            if isinstance(e, OSError) and not about_the_file(e):  # about the machine: stop, naming the file
                name_file(e, storage.join(job.src, item.path))
                raise
            reason = str(e) if isinstance(e, (images.BadImage, CorruptShardError)) else f"cannot read ({e.strerror or e})"
            if job.options.on_error == "fail":
                raise SourceError(f"{storage.join(job.src, item.path)}: {reason}") from None
            yield Skipped(item.path, reason)
        pending += 1
        if pending >= 32:
            tick(pending)
            pending = 0
    tick(pending)


def read_chunk(job: Job) -> ChunkResult:
    """Read one job's samples for the LMDB writer."""
    samples, skipped = [], []
    for got in _samples(job, lmdb_format.check_keys):
        (skipped if isinstance(got, Skipped) else samples).append(got)
    return ChunkResult(job.name, tuple(samples), tuple(skipped))  # type: ignore[arg-type]


def write_shard(job: Job) -> ShardResult:
    """Write one shard atomically; bad inputs are skipped (or raise under on_error='fail').
    An earlier run's progress record goes first (only this shard's: another plan's records
    of shards this run does not reach stay good): left beside this run's shard by a crash
    before the new record, it would vouch for bytes it does not describe."""
    skipped: list[Skipped] = []
    fields: set[str] = set()
    storage.remove(_progress_url(job.dest, job.name), job.storage_options)
    with storage.atomic_writer(storage.join(job.dest, job.name), job.storage_options) as f:
        writer = TarWriter(f)
        for got in _samples(job):
            if isinstance(got, Skipped):
                skipped.append(got)
            else:
                writer.write(*got)
                fields.update(got[1])
        sha = writer.close()
    info = ShardInfo(job.name, len(writer.offsets) - 1, writer.size, sha, tuple(writer.offsets))
    result = ShardResult(info, tuple(sorted(fields)), tuple(skipped))
    record = {"fingerprint": job.fingerprint, "shard": info.to_json(), "fields": result.fields,
              "skipped": [asdict(s) for s in skipped]}
    storage.write_bytes_atomic(_progress_url(job.dest, job.name), json.dumps(record).encode(), job.storage_options)
    return result


def _progress_url(dest: str, name: str) -> str:
    return storage.join(dest, index.PROGRESS_DIR, name + ".json")


def _done(plan: Plan, i: int) -> ShardResult | None:
    """The result of an earlier run of job i, if its shard is complete and unchanged."""
    name, opts = plan.names[i], plan.storage_options
    try:
        record = json.loads(storage.read_bytes(_progress_url(plan.dest, name), opts))
    except (FileNotFoundError, ValueError):
        return None
    if record.get("fingerprint") != plan.fingerprints[i]:
        return None
    info = ShardInfo.from_json(record["shard"])
    skipped = tuple(Skipped(**s) for s in record["skipped"])
    if storage.size(storage.join(plan.dest, name), opts) != info.bytes or _left_out_damage(plan, skipped):
        return None
    return ShardResult(info, tuple(record["fields"]), skipped)


def _left_out_damage(plan: Plan, skipped: Sequence[Skipped]) -> bool:
    """Whether work left out samples of a source shard that did not match its index: such
    work is done again, never kept, since the shard may have been repaired since (the plan's
    fingerprint, made from the source's index, cannot tell)."""
    inherited = set(plan.inherited)
    return any(s.reason.startswith(DAMAGED) and s not in inherited for s in skipped)


# ---------------------------------------------------------------- run


def _refuse_to_replace(dest: str, existing: Index | None) -> None:
    what = (f"a different dataset ({existing.samples} samples, from another source, other options or another "
            "shardkit version)"
            if existing is not None else f"an {index.INDEX_NAME} that cannot be read")
    raise SourceError(f"{storage.display(dest)}: already holds {what}; rerun with --overwrite (overwrite=True) "
                      "to replace it")


def _prepare_dest(dest: str, plan: Plan, overwrite: bool, storage_options: StorageOptions | None) -> Index | None:
    """Check DEST holds nothing but shardkit's own files; clear leftovers. Returns an index
    already committed for this very plan, if any. A finished dataset of another plan is
    replaced only with `overwrite`. Shard names are the dataset's only beside an index or a
    pack's progress folder: another tool's `shard-000000.tar` in a folder that is no
    dataset is never overwritten or removed."""
    names = storage.listdir(dest, storage_options)
    existing = None
    if index.INDEX_NAME in names:
        try:
            existing = index.load(dest, storage_options)
        except (OSError, ValueError):
            pass
    packed = index.PROGRESS_DIR in names or index.INDEX_NAME in names
    own = (index.INDEX_NAME, index.PROGRESS_DIR)
    foreign = [n for n in names if n not in own and not n.startswith(".")  # .DS_Store: hidden, as in SRC
               and not (packed and (_SHARD_RE.match(n) or _TMP_RE.match(n)))]
    if lmdb_format.DATA_FILE in foreign:
        raise SourceError(f"{dest}: holds an LMDB dataset: pack tar shards into another folder")
    if foreign:
        raise SourceError(f"{dest}: destination is not empty and holds files `shardkit pack` did not write "
                          f"(found {foreign[0]!r})")
    if existing is not None and existing.plan == plan.fingerprint:
        if not _left_out_damage(plan, existing.skipped) and all(
                storage.size(storage.join(dest, s.name), storage_options) == s.bytes for s in existing.shards):
            return existing
    elif index.INDEX_NAME in names and not overwrite:
        _refuse_to_replace(dest, existing)
    for name in names:
        if _TMP_RE.match(name):
            storage.remove(storage.join(dest, name), storage_options)
    progress = storage.join(dest, index.PROGRESS_DIR)
    storage.makedirs(progress, storage_options)
    storage.write_bytes_atomic(storage.join(progress, _STARTED), plan.fingerprint.encode(), storage_options)
    if index.INDEX_NAME in names:  # an older dataset (or a damaged copy of this one) is being replaced:
        # from here on readers find the pack unfinished, never a mix of old and new shards
        storage.remove(storage.join(dest, index.INDEX_NAME), storage_options)
    return None


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
    decode_check: bool = False,
    progress: bool | None = None,
    executor: str = "local",
    ray_address: str | None = None,
    storage_options: StorageOptions | None = None,
    overwrite: bool = False,
    stats: dict[str, int] | None = None,
    layout: str = "classes",
    fields: Sequence[str] = (),
) -> Index:
    """Pack the ImageFolder tree `src` (or the images a `.csv` / `.jsonl` manifest lists, or
    convert the shardkit dataset at `src`) into tar shards or an LMDB (`format`), with
    index.json, under `dest`.

    An image's sidecars (`photo.txt`, `photo.json`, `photo.cls`, `photo.seg.png`, and any
    extension `fields` names) become fields of its sample; `layout="flat"` takes images
    anywhere under `src`, without classes. See docs/layouts.md.

    Deterministic: the same input and options give the same samples in the same order (and,
    for tar, byte-identical shards), whatever `workers` is. Safe to rerun after a crash:
    finished work is kept, the rest is written. A finished dataset made from another source
    or with other options is replaced only with `overwrite=True`. Returns the committed
    Index (`index.skipped` lists every input that was left out). `stats`, if given, is
    filled with `kept` (source files in work an earlier run finished), `written` (source
    files this run packed) and `unchanged` (1 when DEST already held this very pack, whole).

    `decode_check=True` decodes every image in full, as a reader's decoder would (a slower
    pack), so that a corrupt image whose ends look right is skipped, listed, at pack time
    (or stops the pack under on_error="fail") instead of failing in training.

    `executor="ray"` runs the same jobs as Ray tasks on the cluster at `ray_address`
    (inputs and outputs must then be reachable from every node: a shared file system or
    URLs); the output is the same as the local process pool's.
    """
    src, dest = checks.path("src", src), checks.path("dest", dest)
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', not {executor!r}")
    if format not in ("tar", "lmdb"):
        raise ValueError(f"format must be 'tar' or 'lmdb', not {format!r}")
    seed, shuffle, overwrite = checks.integer("seed", seed), checks.flag("shuffle", shuffle), checks.flag("overwrite", overwrite)
    storage_options = checks.mapping("storage_options", storage_options)
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', not {on_error!r}")
    max_count, workers = checks.optional("max_count", max_count, 1), checks.optional("workers", workers, 1)
    resize, quality = checks.optional("resize", resize, 1), checks.optional("quality", quality, 1, 100)
    if max_size is not None:
        max_size = checks.size("max_size", max_size, 1)
        if format == "tar" and max_size < RECORD:
            raise ValueError(f"max_size must be at least {RECORD} bytes (10KiB) for tar shards, the size of the "
                             f"smallest tar file, not {max_size}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'classes' or 'flat', not {layout!r}")
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats must be a dict to fill (or None), not {stats!r}")
    if format == "lmdb" and not storage.is_local(dest):
        raise SourceError(f"{storage.display(dest)}: LMDB output must be a local path (copy it up afterwards)")
    _check_apart(src, dest)
    if storage.is_local(dest) and os.path.exists(there := storage.local_path(dest)) and not os.path.isdir(there):
        raise SourceError(f"{dest}: a file, not a folder (DEST is the folder the dataset goes in)")  # or a device
    options = Options(resize=resize, quality=quality, on_error=on_error, decode_check=checks.flag("decode_check", decode_check))
    if format == "lmdb":  # one transaction per job, held in memory: keep them moderate
        max_size = min(max_size or LMDB_JOB, LMDB_JOB)
    if not storage.is_local(src) and source_kind(src, storage_options) == "lmdb":
        src = local_lmdb(src, storage_options, None)  # an LMDB is read from a whole local copy
    plan = make_plan(src, dest, max_count=max_count, max_size=max_size, shuffle=shuffle, seed=seed,
                     options=options, fmt=format, storage_options=storage_options, layout=layout, fields=fields)
    unusable = [s for s in plan.skipped if s.reason != HIDDEN]
    if on_error == "fail" and unusable:
        raise SourceError(f"{storage.join(plan.src, unusable[0].path)}: {unusable[0].reason}")
    runner = (executors.ray(ray_address, sizes=lambda job: len(job.items)) if executor == "ray"
              else executors.local(workers or os.cpu_count() or 1))
    run = _pack_tar if format == "tar" else _pack_lmdb
    tally = stats if stats is not None else {}
    tally.update(kept=len(plan.order), written=0, unchanged=1)  # what a finished pack's rerun reports
    return run(plan, dest, runner, progress, overwrite, tally, storage_options)


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


def _require_samples(plan: Plan, samples: int, skipped: tuple[Skipped, ...]) -> None:
    """A pack that kept nothing fails (exit 1) rather than commit an empty dataset."""
    if samples == 0:
        first = f" (first: {skipped[0].path}: {skipped[0].reason})" if skipped else ""
        raise SourceError(f"{plan.src}: no usable samples, {len(skipped)} skipped{first}")


def _bar(plan: Plan, done: int, progress: bool | None) -> Any:
    from tqdm import tqdm

    show = progress if progress is not None else sys.stderr.isatty()
    total = len(plan.order)
    return tqdm(total=total, initial=done, unit="img", disable=not show, desc="pack", smoothing=0.1)


def _pack_tar(plan: Plan, dest: str, runner: executors.Runner, progress: bool | None, overwrite: bool,
              stats: dict[str, int], storage_options: StorageOptions | None) -> Index:
    storage.makedirs(dest, storage_options)
    committed = _prepare_dest(dest, plan, overwrite, storage_options)
    if committed is not None:
        _refuse_earlier_skips(plan, committed.skipped)
        _cleanup(dest, set(plan.names), storage_options)  # what a crash in the last run's cleanup left
        return committed
    results: dict[str, ShardResult] = {}
    todo = []
    for i, name in enumerate(plan.names):
        done = _done(plan, i)
        if done is None:
            todo.append(i)
        else:
            results[name] = done
    _refuse_earlier_skips(plan, [s for r in results.values() for s in r.skipped])
    initial = sum(plan.size(i) for i in range(len(plan.names)) if plan.names[i] in results)
    stats.update(kept=initial, written=len(plan.order) - initial, unchanged=0)
    with _bar(plan, initial, progress) as bar:
        runner(write_shard, JobList(plan, todo), lambda r: results.__setitem__(r.info.name, r),
               lambda n: bar.update(initial + n - bar.n))
    ordered = [results[name] for name in plan.names]
    skipped = _all_skipped(plan, [s for r in ordered for s in r.skipped])
    try:
        _require_samples(plan, sum(r.info.samples for r in ordered), skipped)
    except SourceError:  # leave no unfinished pack whose rerun could only fail again
        _cleanup(dest, set(), storage_options)
        raise
    idx = Index(
        shards=tuple(r.info for r in ordered),
        kind="tar",
        fields=tuple(sorted({f for r in ordered for f in r.fields})),
        classes=plan.classes,
        skipped=skipped,
        plan=plan.fingerprint,
    )
    index.save(idx, dest, storage_options)
    _cleanup(dest, set(plan.names), storage_options)
    return idx


def _refuse_earlier_skips(plan: Plan, skipped: Sequence[Skipped]) -> None:
    """Under on_error="fail", refuse to keep work of an earlier run that left a file out
    (that run was under "skip"); hidden entries and what a converted dataset's own pack
    left out do not count."""
    if plan.options.on_error != "fail":
        return
    inherited = set(plan.inherited)
    first = next((s for s in skipped if s.reason != HIDDEN and s not in inherited), None)
    if first is not None:
        raise SourceError(f"{storage.join(plan.src, first.path)}: {first.reason} (left out by an earlier run "
                          "of this pack under --on-error skip)")


def _all_skipped(plan: Plan, more: list[Skipped]) -> tuple[Skipped, ...]:
    """What this pack left out, and what the pack of a dataset being converted left out."""
    return tuple(sorted([*plan.inherited, *plan.skipped, *more], key=lambda s: s.path))


def _pack_lmdb(plan: Plan, dest: str, runner: executors.Runner, progress: bool | None, overwrite: bool,
               stats: dict[str, int], storage_options: StorageOptions | None) -> Index:
    """Workers read and check samples; this process writes them, one transaction per job,
    each recording the progress, so a rerun continues after the last committed job."""
    path = storage.local_path(dest)
    names = os.listdir(path) if os.path.isdir(path) else []
    others = [n for n in names if n not in _LMDB_FILES and not _TMP_RE.match(n) and not n.startswith(".")]
    if others:
        if index.INDEX_NAME in names:
            raise SourceError(f"{dest}: holds tar shards: pack an LMDB into another folder")
        raise SourceError(f"{dest}: destination is not empty and not an LMDB dataset (found {others[0]!r})")
    for name in names:
        if _TMP_RE.match(name):
            os.remove(os.path.join(path, name))
    if not overwrite and index.INDEX_NAME in names:  # refuse before opening it
        try:
            existing = index.load(dest)
        except (OSError, ValueError):  # the index stored inside the LMDB decides, below
            existing = None
        if existing is not None and existing.plan != plan.fingerprint:
            _refuse_to_replace(dest, existing)
    os.makedirs(path, exist_ok=True)
    writer = lmdb_format.Writer(path)
    try:
        finished = writer.finished()
        progress_doc = writer.progress()
        if finished is None and progress_doc is None and writer.entries():
            raise SourceError(f"{dest}: holds an LMDB that `shardkit pack` did not write: pack into another folder")
        if finished is not None or (progress_doc or {}).get("plan") not in (None, plan.fingerprint):
            existing = Index.from_json(finished, dest) if finished is not None else None
            ours = existing is not None and existing.plan == plan.fingerprint
            if ours and not _left_out_damage(plan, existing.skipped):
                _refuse_earlier_skips(plan, existing.skipped)
                index.save(existing, dest)  # in case the crash came between the two commits
                return existing
            if existing is not None and not ours and not overwrite:
                _refuse_to_replace(dest, existing)
            _remove_lmdb(writer, path)  # another dataset, or another plan's unfinished one, lives here: replace it
            writer = lmdb_format.Writer(path)
            progress_doc = None
        done = int((progress_doc or {}).get("chunks", 0))
        records: list[dict] = []
        for i in range(done):
            with writer.env.begin() as txn:
                records.append(json.loads(txn.get(_chunk_key(i))))
        if _left_out_damage(plan, [Skipped(**s) for r in records for s in r["skipped"]]):  # start again
            _remove_lmdb(writer, path)
            writer, done, records = lmdb_format.Writer(path), 0, []
        _refuse_earlier_skips(plan, [Skipped(**s) for r in records for s in r["skipped"]])

        def commit(result: ChunkResult) -> None:
            i = len(records)
            record = {"keys": [k for k, _ in result.samples],
                      "sizes": [sum(len(v) for v in f.values()) for _, f in result.samples],
                      "fields": sorted({e for _, f in result.samples for e in f}),
                      "skipped": [asdict(s) for s in result.skipped]}
            meta = {_chunk_key(i): json.dumps(record).encode(),
                    lmdb_format.PROGRESS_KEY: json.dumps({"plan": plan.fingerprint, "chunks": i + 1}).encode()}
            writer.write(result.samples, meta)
            records.append(record)

        todo = JobList(plan, range(done, len(plan.names)))
        initial = sum(plan.size(i) for i in range(done))
        stats.update(kept=initial, written=len(plan.order) - initial, unchanged=0)
        with _bar(plan, initial, progress) as bar:
            runner(read_chunk, todo, commit, lambda n: bar.update(initial + n - bar.n))
        keys = [k for r in records for k in r["keys"]]
        skipped = _all_skipped(plan, [Skipped(**s) for r in records for s in r["skipped"]])
        try:
            _require_samples(plan, len(keys), skipped)
        except SourceError:  # leave no unfinished pack whose rerun could only fail again
            _remove_lmdb(writer, path)
            raise
        idx = Index(
            shards=(ShardInfo("data.mdb", len(keys), sum(n for r in records for n in r["sizes"])),),
            kind="lmdb",
            fields=tuple(sorted({f for r in records for f in r["fields"]})),
            classes=plan.classes,
            skipped=skipped,
            plan=plan.fingerprint,
            extra={"keys": keys, "sizes": [n for r in records for n in r["sizes"]]},
        )
        doc = idx.to_json().encode()
        done_keys = [_chunk_key(i) for i in range(len(records))] + [lmdb_format.PROGRESS_KEY]
        writer.write([], {lmdb_format.INDEX_KEY: doc}, delete=done_keys)  # finished, in one transaction
    finally:
        writer.close()
    index.save(idx, dest)
    return idx


def _remove_lmdb(writer: lmdb_format.Writer, path: str) -> None:
    """Close the writer and remove the LMDB's files, the index first."""
    writer.close()
    for name in _LMDB_FILES:
        storage.remove(os.path.join(path, name))


def _chunk_key(i: int) -> bytes:
    return f"{lmdb_format.PROGRESS_KEY.decode()}/{i:08d}".encode()


def _cleanup(dest: str, keep: set[str], storage_options: StorageOptions | None) -> None:
    """After commit: drop the shards not named in `keep` (an earlier, different plan's) and
    the progress records (the folder last: a rerun after a crash in between finds it and
    cleans up again)."""
    progress = storage.join(dest, index.PROGRESS_DIR)
    names = storage.listdir(dest, storage_options)
    if index.PROGRESS_DIR not in names:
        return
    for name in names:
        if _SHARD_RE.match(name) and name not in keep:
            storage.remove(storage.join(dest, name), storage_options)
    for name in storage.listdir(progress, storage_options):
        storage.remove(storage.join(progress, name), storage_options)
    storage.remove_dir(progress, storage_options)
