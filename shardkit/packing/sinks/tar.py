"""Tar shards for the commit mechanism: each job writes its shard (under a temporary name,
renamed into place when complete) and then a progress record beside it, in
DEST/.shardkit-progress/; index.json is written last, and the records dropped after it."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, TypeVar

import numpy as np

from ... import index, storage
from ...index import offsets
from ...errors import SourceError
from ...formats import lmdb as lmdb_format
from ...formats.tar import BLOCK, RECORD
from ...formats.tar_writer import TarWriter
from ...index import Index, ShardInfo, Skipped
from ...storage import StorageOptions
from .. import jobs
from ..commit import SHARD_RE, TMP_RE, JobResult, Sink, left_out_damage, refuse_to_replace
from ..plan import Job

T = TypeVar("T")
R = TypeVar("R")
STARTED = "started"  # in the progress folder, written first: even an object store then shows the pack unfinished


def write_shard(job: Job, earlier: bool = True) -> JobResult:
    """Write one shard atomically; bad inputs are skipped (or raise under on_error='raise').
    An earlier run's progress record goes first (only this shard's: another plan's records
    of shards this run does not reach stay good): left beside this run's shard by a crash
    before the new record, it would vouch for bytes it does not describe. Not `earlier`:
    DEST held nothing of shardkit's when this pack began, so there is no record to remove (a
    store's round trip saved before each shard)."""
    skipped: list[Skipped] = []
    fields: set[str] = set()
    if earlier:  # its table too: a record of this run found beside an old table would vouch for it
        _remove([_progress_url(job.dest, job.name), _table_url(job.dest, job.name)], job.storage_options)
    with storage.atomic_writer(storage.join(job.dest, job.name), job.storage_options) as f:
        writer = TarWriter(f)
        for got in jobs.job_samples(job):
            if isinstance(got, Skipped):
                skipped.append(got)
            else:
                writer.write(*got)
                fields.update(got[1])
        sha = writer.close()
    info = ShardInfo(job.name, len(writer.offsets) - 1, writer.size, sha)
    result = JobResult(info, tuple(sorted(fields)), tuple(skipped))
    record = {
        "fingerprint": job.fingerprint,
        "shard": info.to_json(),
        "fields": result.fields,
        "skipped": [asdict(s) for s in skipped],
    }
    table = np.asarray(writer.offsets, dtype=offsets.DTYPE).tobytes()  # the shard's offsets, for the commit
    # both at once (a store's round trip each): a record found without its table (the earlier
    # one was removed above) is not kept (`_done`)
    writes = {_table_url(job.dest, job.name): table, _progress_url(job.dest, job.name): json.dumps(record).encode()}
    _at_once(lambda url: storage.write_bytes_atomic(url, writes[url], job.storage_options), list(writes))
    return result


def _progress_url(dest: str, name: str) -> str:
    return storage.join(dest, index.PROGRESS_DIR, name + ".json")


def _table_url(dest: str, name: str) -> str:
    return storage.join(dest, index.PROGRESS_DIR, name + ".offsets")


def _tables(dest: str, names: Sequence[str], storage_options: StorageOptions | None) -> Iterator[np.ndarray]:
    """The offset tables the jobs wrote, in the order of `names`: read on threads a few
    dozen ahead (an object store answers each read in tens of ms), one batch held at a time."""

    def read(name: str) -> np.ndarray:
        return np.frombuffer(storage.read_bytes(_table_url(dest, name), storage_options), dtype=offsets.DTYPE)

    with ThreadPoolExecutor(16, thread_name_prefix="shardkit-commit") as pool:
        for at in range(0, len(names), 64):
            yield from pool.map(read, names[at : at + 64])


def _payload(limit: int) -> int:
    """A shard's bytes for its members: a tar ends in 2 zero blocks, padded to a record."""
    return max(1, limit // RECORD * RECORD - 2 * BLOCK)


class TarSink(Sink):
    name = "tar"
    work = staticmethod(write_shard)
    job_name = "shard-{:06d}.tar"
    payload = staticmethod(_payload)

    min_size = RECORD
    min_size_note = "10KiB for tar shards (the smallest tar file)"
    fresh = False  # DEST held nothing of shardkit's as this pack began (`prepare`)

    @staticmethod
    def job_limit(max_size: int | None) -> int | None:
        if max_size is not None and max_size < RECORD:
            raise ValueError(
                f"max_size must be at least {RECORD} bytes (10KiB) for tar shards, the size of the "
                f"smallest tar file, not {max_size}"
            )
        return max_size

    def prepare(self, overwrite: bool) -> Index | None:
        """Check DEST holds nothing but shardkit's own files; clear leftovers. Returns an index
        already committed for this very plan, if any. A finished dataset of another plan is
        replaced only with `overwrite`. Shard names are the dataset's only beside an index or a
        pack's progress folder: another tool's `shard-000000.tar` in a folder that is no
        dataset is never overwritten or removed."""
        dest, plan, opts = self.dest, self.plan, self.storage_options
        storage.makedirs(dest, opts)
        names = storage.listdir(dest, opts)
        existing = None
        if index.INDEX_NAME in names:
            try:
                existing = index.load(dest, opts)
            except (OSError, ValueError):
                pass
        packed = index.PROGRESS_DIR in names or index.INDEX_NAME in names
        own = (index.INDEX_NAME, index.PROGRESS_DIR)
        foreign = [
            n
            for n in names
            if n not in own
            and not n.startswith(".")  # .DS_Store: hidden, as in SRC
            and not (packed and (SHARD_RE.match(n) or offsets.PATTERN.match(n) or TMP_RE.match(n)))
        ]
        if lmdb_format.DATA_FILE in foreign:
            raise SourceError(f"{dest}: holds an LMDB dataset: pack tar shards into another folder")
        if foreign:
            raise SourceError(
                f"{dest}: destination is not empty and holds files `shardkit pack` did not write (found {foreign[0]!r})"
            )
        if existing is not None and existing.plan == plan.fingerprint:
            whole = existing.offsets_file is None or existing.offsets_file.file in names
            if (
                whole
                and not left_out_damage(plan, existing.skipped)
                and all(storage.size(storage.join(dest, s.name), opts) == s.bytes for s in existing.shards)
            ):
                return existing
        elif index.INDEX_NAME in names and not overwrite:
            refuse_to_replace(dest, existing)
        for name in names:
            if TMP_RE.match(name):
                storage.remove(storage.join(dest, name), opts)
        progress = storage.join(dest, index.PROGRESS_DIR)
        # nothing of shardkit's here (no earlier run's records, shards, offsets file or index):
        # nothing to keep, remove or find again after the commit
        self.fresh = not any(
            n in own or SHARD_RE.match(n) or offsets.PATTERN.match(n) or TMP_RE.match(n) for n in names
        )
        if self.fresh:
            self.work = functools.partial(write_shard, earlier=False)
        storage.makedirs(progress, opts)
        storage.write_bytes_atomic(storage.join(progress, STARTED), plan.fingerprint.encode(), opts)
        if index.INDEX_NAME in names:  # an older dataset (or a damaged copy of this one) is being replaced:
            # from here on readers find the pack unfinished, never a mix of old and new shards
            storage.remove(storage.join(dest, index.INDEX_NAME), opts)
        return None

    def kept(self) -> dict[int, JobResult]:
        """The jobs an earlier run finished: the progress records listed once, those there
        read on threads (a store answers each in tens of ms; a fresh DEST has none to read)."""
        if self.fresh:
            return {}
        listed = set(storage.listdir(storage.join(self.dest, index.PROGRESS_DIR), self.storage_options))
        there = [i for i, name in enumerate(self.plan.names) if name + ".json" in listed]
        done = dict(zip(there, _at_once(self._done, there)))
        return {i: result for i, result in done.items() if result is not None}

    def _done(self, i: int) -> JobResult | None:
        """The result of an earlier run of job i, if its shard is complete and unchanged."""
        plan, opts = self.plan, self.storage_options
        name = plan.names[i]
        try:
            record = json.loads(storage.read_bytes(_progress_url(self.dest, name), opts))
        except (FileNotFoundError, ValueError):
            return None
        if record.get("fingerprint") != plan.fingerprints[i]:
            return None
        info = ShardInfo.from_json(record["shard"])
        skipped = tuple(Skipped(**s) for s in record["skipped"])
        if storage.size(storage.join(self.dest, name), opts) != info.bytes or left_out_damage(plan, skipped):
            return None
        if storage.size(_table_url(self.dest, name), opts) != (info.samples + 1) * offsets.DTYPE.itemsize:
            return None  # a record of shardkit 0.1 (its offsets inside), or a table gone
        return JobResult(info, tuple(record["fields"]), skipped)

    def record(self, result: JobResult) -> JobResult:
        return result  # the worker wrote the shard and its progress record

    def make_index(self, results: Sequence[JobResult], base: dict[str, Any]) -> Index:
        """The index, its shards' offsets streamed from the jobs' tables into its offsets."""
        idx = Index(shards=tuple(r.info for r in results), **base)
        return index.with_offsets_file(
            idx, self.dest, _tables(self.dest, self.plan.names, self.storage_options), self.storage_options
        )

    def commit(self, idx: Index, fresh: bool) -> None:
        """Into a DEST that held nothing of shardkit's as this pack began (`self.fresh`) there
        is no other offsets file or shard to find: only the progress folder is listed (what
        is in it goes, a temporary file a killed attempt left included), not DEST (a store's
        round trip each)."""
        if fresh:
            index.save(idx, self.dest, self.storage_options, tidy=not self.fresh)
        if fresh and self.fresh:
            remove_progress(self.dest, self.storage_options)
        else:
            cleanup(self.dest, set(self.plan.names), self.storage_options)

    def abandon(self) -> None:
        cleanup(self.dest, set(), self.storage_options)


def cleanup(dest: str, keep: set[str], storage_options: StorageOptions | None) -> None:
    """After commit: drop the shards not named in `keep` (an earlier, different plan's) and
    the progress records (the folder last: a rerun after a crash in between finds it and
    cleans up again)."""
    names = storage.listdir(dest, storage_options)
    if index.PROGRESS_DIR in names:
        stale = [storage.join(dest, name) for name in names if SHARD_RE.match(name) and name not in keep]
        remove_progress(dest, storage_options, stale)


def remove_progress(dest: str, storage_options: StorageOptions | None, also: Sequence[str] = ()) -> None:
    """Remove the URLs `also` and what is in the progress folder, then the folder."""
    progress = storage.join(dest, index.PROGRESS_DIR)
    listed = [storage.join(progress, name) for name in storage.listdir(progress, storage_options)]
    _remove([*also, *listed], storage_options)
    storage.remove_dir(progress, storage_options)


def _remove(urls: Sequence[str], storage_options: StorageOptions | None) -> None:
    _at_once(lambda url: storage.remove(url, storage_options), urls)


def _at_once(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """`fn` of each item on threads (a store's round trip each, at once), results in order."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(min(32, len(items)), thread_name_prefix="shardkit-commit") as pool:
        return list(pool.map(fn, items))
