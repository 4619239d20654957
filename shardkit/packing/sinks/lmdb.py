"""An LMDB for the commit mechanism: workers read and check a job's samples; the pack
process writes them, one transaction per job that also records the job as done (a
progress key inside the LMDB), so a rerun continues after the last committed job. The
index goes into the LMDB, with the progress keys dropped, in one last transaction, then
beside it as index.json."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from ... import index, storage
from ...errors import SourceError
from ...formats import lmdb as lmdb_format
from ...index import Index, ShardInfo, Skipped
from ...storage import StorageOptions
from ...units import parse_size
from .. import jobs
from ..commit import TMP_RE, JobResult, Sink, left_out_damage, refuse_to_replace
from ..plan import Job, Plan

JOB_BYTES = parse_size("64MB")  # an LMDB pack's most bytes per job (one transaction, held in memory)
_FILES = (index.INDEX_NAME, lmdb_format.DATA_FILE, lmdb_format.LOCK_FILE)  # removal order: the index first


def read_chunk(job: Job) -> JobResult:
    """Read and check one job's samples for the LMDB writer."""
    got: list[tuple[str, dict[str, bytes]]] = []
    skipped: list[Skipped] = []
    for sample in jobs.job_samples(job, lmdb_format.check_keys):
        if isinstance(sample, Skipped):
            skipped.append(sample)
        else:
            got.append(sample)
    sizes = tuple(sum(len(v) for v in f.values()) for _, f in got)
    fields = tuple(sorted({e for _, f in got for e in f}))
    return JobResult(
        ShardInfo(job.name, len(got), sum(sizes)),
        fields,
        tuple(skipped),
        keys=tuple(k for k, _ in got),
        sizes=sizes,
        samples=tuple(got),
    )


class LmdbSink(Sink):
    name = "lmdb"
    work = staticmethod(read_chunk)
    job_name = "chunk-{:06d}"  # a unit of work: one transaction
    local_only = True  # LMDB needs a file system with mmap and locks

    @staticmethod
    def job_limit(max_size: int | None) -> int:
        """One transaction per job, held in memory: keep them moderate."""
        return min(max_size or JOB_BYTES, JOB_BYTES)

    def __init__(self, plan: Plan, dest: str, storage_options: StorageOptions | None = None):
        super().__init__(plan, dest, storage_options)
        self.path = storage.local_path(dest)
        self.writer: lmdb_format.Writer | None = None
        self.done: list[JobResult] = []  # the committed jobs, in order

    def prepare(self, overwrite: bool) -> Index | None:
        dest, path, plan = self.dest, self.path, self.plan
        names = os.listdir(path) if os.path.isdir(path) else []
        others = [n for n in names if n not in _FILES and not TMP_RE.match(n) and not n.startswith(".")]
        if others:
            if index.INDEX_NAME in names:
                raise SourceError(f"{dest}: holds tar shards: pack an LMDB into another folder")
            raise SourceError(f"{dest}: destination is not empty and not an LMDB dataset (found {others[0]!r})")
        for name in names:
            if TMP_RE.match(name):
                os.remove(os.path.join(path, name))
        if not overwrite and index.INDEX_NAME in names:  # refuse before opening it
            try:
                existing = index.load(dest)
            except (OSError, ValueError):  # the index stored inside the LMDB decides, below
                existing = None
            if existing is not None and existing.plan != plan.fingerprint:
                refuse_to_replace(dest, existing)
        os.makedirs(path, exist_ok=True)
        writer = self.writer = lmdb_format.Writer(path)
        finished, progress = writer.finished(), writer.progress()
        if finished is None and progress is None and writer.entries():
            raise SourceError(f"{dest}: holds an LMDB that `shardkit pack` did not write: pack into another folder")
        if finished is not None or (progress or {}).get("plan") not in (None, plan.fingerprint):
            existing = Index.from_json(finished, dest) if finished is not None else None
            ours = existing is not None and existing.plan == plan.fingerprint
            if existing is not None and ours and not left_out_damage(plan, existing.skipped):
                return existing
            if existing is not None and not ours and not overwrite:
                refuse_to_replace(dest, existing)
            self._restart()  # another dataset, or another plan's unfinished one, lives here: replace it
        return None

    def kept(self) -> dict[int, JobResult]:
        """The jobs committed by an earlier run: a prefix of the plan (one writer, in order).
        One that left out a damaged source shard's samples starts the LMDB again."""
        assert self.writer is not None
        count = int((self.writer.progress() or {}).get("chunks", 0))
        with self.writer.env.begin() as txn:
            records = [json.loads(txn.get(_chunk_key(i))) for i in range(count)]
        self.done = [
            JobResult(
                ShardInfo(self.plan.names[i], len(r["keys"]), sum(r["sizes"])),
                tuple(r["fields"]),
                tuple(Skipped(**s) for s in r["skipped"]),
                tuple(r["keys"]),
                tuple(r["sizes"]),
            )
            for i, r in enumerate(records)
        ]
        if left_out_damage(self.plan, [s for r in self.done for s in r.skipped]):
            self._restart()
        return dict(enumerate(self.done))

    def record(self, result: JobResult) -> JobResult:
        assert self.writer is not None
        i = len(self.done)
        record = {
            "keys": list(result.keys),
            "sizes": list(result.sizes),
            "fields": list(result.fields),
            "skipped": [asdict(s) for s in result.skipped],
        }
        meta = {
            _chunk_key(i): json.dumps(record).encode(),
            lmdb_format.PROGRESS_KEY: json.dumps({"plan": self.plan.fingerprint, "chunks": i + 1}).encode(),
        }
        self.writer.write(result.samples, meta)
        kept = JobResult(result.info, result.fields, result.skipped, result.keys, result.sizes)  # samples dropped
        self.done.append(kept)
        return kept

    def make_index(self, results: Sequence[JobResult], base: dict[str, Any]) -> Index:
        keys = [k for r in results for k in r.keys]
        sizes = [n for r in results for n in r.sizes]
        return Index(
            shards=(ShardInfo(lmdb_format.DATA_FILE, len(keys), sum(sizes)),),
            extra={"keys": keys, "sizes": sizes},
            **base,
        )

    def commit(self, idx: Index, fresh: bool) -> None:
        if fresh:
            assert self.writer is not None
            done_keys = [_chunk_key(i) for i in range(len(self.done))] + [lmdb_format.PROGRESS_KEY]
            self.writer.write([], {lmdb_format.INDEX_KEY: idx.to_json().encode()}, delete=done_keys)  # one transaction
        self.close()
        index.save(idx, self.dest)  # (again, after a crash between the two commits)

    def abandon(self) -> None:
        """Close the writer and remove the LMDB's files, the index first."""
        self.close()
        for name in _FILES:
            storage.remove(os.path.join(self.path, name))

    def _restart(self) -> None:
        self.abandon()
        self.writer, self.done = lmdb_format.Writer(self.path), []

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _chunk_key(i: int) -> bytes:
    return f"{lmdb_format.PROGRESS_KEY.decode()}/{i:08d}".encode()
