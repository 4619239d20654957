"""The one resume/commit mechanism of a pack, whatever the format:

    prepare DEST -> keep an earlier run's finished jobs -> run the rest -> commit the index

A format plugs in as a `Sink` (sinks/tar.py, sinks/lmdb.py): where a job's work is recorded
as done (a progress file beside a shard, a progress key inside the LMDB), how it is
checked on a rerun, and how the dataset is committed. A rerun after a crash keeps every
job whose record matches its fingerprint, so it ends with what an uninterrupted run makes.
"""

from __future__ import annotations

import re
import sys
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import formats, index, storage
from ..index import offsets
from ..errors import SourceError, shown_name
from ..index import Index, ShardInfo, Skipped
from ..storage import StorageOptions
from . import executors, lock
from .plan import Job, JobList, Plan
from .jobs import DAMAGED
from .inputs.folder import HIDDEN


SHARD_RE = re.compile(r"^shard-\d{6,}\.tar$")
TMP_RE = re.compile(
    rf"^({SHARD_RE.pattern[1:-1]}|{offsets.PATTERN.pattern[1:-1]}|{re.escape(index.INDEX_NAME)})"
    rf"{re.escape(storage.TMP_MARK)}[0-9a-f]{{12}}$"
)
"""What an interrupted pack leaves: a shard's, the offsets file's or the index's temporary file
(storage.atomic_writer's names)."""


@dataclass(frozen=True)
class JobResult:
    """What one job made: its shard (for LMDB, the job's share of the one file), its fields
    and what it left out. `samples` carries an LMDB job's samples to the one writer."""

    info: ShardInfo
    fields: tuple[str, ...]
    skipped: tuple[Skipped, ...]
    keys: tuple[str, ...] = ()  # LMDB: the job's keys and sizes, for the index
    sizes: tuple[int, ...] = ()
    samples: tuple[tuple[str, dict[str, bytes]], ...] = field(default=(), repr=False)


class Sink(ABC):
    """What a format does for the commit mechanism. Subclasses name the format, say how a
    job's unit is named and bounded, and give `work`, the job function run in a worker
    process (a top-level function, as it is pickled)."""

    name: str  # the format's name, the index's `kind`
    job_name: str  # a job's unit, by job number: "shard-{:06d}.tar"
    local_only = False  # whether DEST must be a local path
    min_size = 1  # the smallest max_size it can keep to, and why (for the CLI's message)
    min_size_note = "1 byte"
    work: Callable[[Job], JobResult]

    def __init__(self, plan: Plan, dest: str, storage_options: StorageOptions | None):
        self.plan, self.dest, self.storage_options = plan, dest, storage_options

    @staticmethod
    def job_limit(max_size: int | None) -> int | None:
        """The most bytes a job may take, from the user's max_size (checked)."""
        return max_size

    @staticmethod
    def payload(limit: int) -> int:
        """The samples' share of a job's `limit` bytes (the format's own overhead aside)."""
        return limit

    @abstractmethod
    def prepare(self, overwrite: bool) -> Index | None:
        """Check and tidy DEST; the index already committed for this very plan, if any."""

    @abstractmethod
    def kept(self) -> dict[int, JobResult]:
        """The jobs an earlier run of this plan finished, still good."""

    @abstractmethod
    def record(self, result: JobResult) -> JobResult:
        """In the pack process, as each job ends: make its work durable and marked done."""

    @abstractmethod
    def make_index(self, results: Sequence[JobResult], base: dict[str, Any]) -> Index:
        """The dataset's index from every job's result (`base`: the fields common to all formats)."""

    @abstractmethod
    def commit(self, idx: Index, fresh: bool) -> None:
        """Write the index last, then drop the progress records (`fresh`: written by this run)."""

    @abstractmethod
    def abandon(self) -> None:
        """Take back what this pack wrote (it kept no sample)."""

    def close(self) -> None:  # noqa: B027 - most sinks hold nothing open
        """Release what the sink holds open."""


def run(
    plan: Plan,
    sink: Sink,
    runner: executors.Runner[Job, JobResult],
    progress: bool | None,
    overwrite: bool,
    stats: dict[str, int],
) -> Index:
    """Pack `plan` through `sink`, keeping an earlier run's finished work, holding DEST's
    lock throughout (a second pack into it is refused, see lock.py)."""
    with lock.held(sink.dest, sink.storage_options) as holding:
        return _run(plan, sink, runner, progress, overwrite, stats, holding)


def _run(
    plan: Plan,
    sink: Sink,
    runner: executors.Runner[Job, JobResult],
    progress: bool | None,
    overwrite: bool,
    stats: dict[str, int],
    holding: lock.Holding,
) -> Index:
    try:
        committed = sink.prepare(overwrite)
        if committed is not None:
            refuse_earlier_skips(plan, committed.skipped)
            holding.confirm()
            sink.commit(committed, fresh=False)  # finishes what a crash in the last run's cleanup left
            return committed
        results = sink.kept()
        refuse_earlier_skips(plan, [s for r in results.values() for s in r.skipped])
        todo = [i for i in range(len(plan.names)) if i not in results]
        initial = sum(plan.size(i) for i in results)
        stats.update(kept=initial, written=len(plan.order) - initial, unchanged=0)
        position = {name: i for i, name in enumerate(plan.names)}

        def done(result: JobResult) -> None:
            holding.check()  # another pack took DEST's lock over: stop before recording more
            results[position[result.info.name]] = sink.record(result)

        with _bar(plan, initial, progress) as bar:
            runner(sink.work, JobList(plan, todo), done, lambda n: bar.update(initial + n - bar.n))
        ordered = [results[i] for i in range(len(plan.names))]
        skipped = tuple(
            sorted([*plan.inherited, *plan.skipped, *(s for r in ordered for s in r.skipped)], key=lambda s: s.path)
        )
        samples = sum(r.info.samples for r in ordered)
        if samples == 0:  # a pack that kept nothing fails (exit 1) rather than commit an empty dataset
            holding.check()  # (what is in DEST is another pack's, once it has taken it over)
            sink.abandon()  # and leaves no unfinished pack whose rerun could only fail again
            first = f" (first: {shown_name(skipped[0].path)}: {skipped[0].reason})" if skipped else ""
            raise SourceError(f"{plan.src}: no usable samples, {len(skipped)} skipped{first}")
        base = {
            "kind": sink.name,
            "fields": tuple(sorted({f for r in ordered for f in r.fields})),
            "classes": plan.classes,
            "skipped": skipped,
            "plan": plan.fingerprint,
        }
        idx = _made_and_pinned(sink, ordered, base)
        holding.confirm()  # still this pack's DEST, for a lease to come
        sink.commit(idx, fresh=True)
        return idx
    finally:
        sink.close()


def _made_and_pinned(sink: Sink, results: Sequence[JobResult], base: dict[str, Any]) -> Index:
    """The sink's index with its shards' versions (they are in place): the one listing that
    finds those runs while the offsets file is made (a store's round trip each)."""
    plan = sink.plan
    if not formats.get(sink.name).sharded:
        return sink.make_index(results, base)
    with ThreadPoolExecutor(1, thread_name_prefix="shardkit-commit") as pool:
        pins = pool.submit(storage.pins, plan.dest, list(plan.names), plan.storage_options)
        made = sink.make_index(results, base)
    return index.with_pins(made, pins.result())


def left_out_damage(plan: Plan, skipped: Sequence[Skipped]) -> bool:
    """Whether work left out samples of a source shard that did not match its index: such
    work is done again, never kept, since the shard may have been repaired since (the plan's
    fingerprint, made from the source's index, cannot tell)."""
    inherited = set(plan.inherited)
    return any(s.reason.startswith(DAMAGED) and s not in inherited for s in skipped)


def refuse_earlier_skips(plan: Plan, skipped: Sequence[Skipped]) -> None:
    """Under on_error="raise", refuse to keep work of an earlier run that left a file out
    (that run was under "skip"); hidden entries and what a converted dataset's own pack
    left out do not count."""
    if plan.options.on_error != "raise":
        return
    inherited = set(plan.inherited)
    first = next((s for s in skipped if s.reason != HIDDEN and s not in inherited), None)
    if first is not None:
        raise SourceError(
            f"{shown_name(storage.join(plan.src, first.path))}: {first.reason} (left out by an earlier run "
            "of this pack under --on-error skip)"
        )


def refuse_to_replace(dest: str, existing: Index | None) -> None:
    what = (
        f"a different dataset ({existing.samples} samples, from another source, other options or another "
        "shardkit version)"
        if existing is not None
        else "an index.json that cannot be read"
    )
    raise SourceError(
        f"{storage.display(dest)}: already holds {what}; rerun with --overwrite (overwrite=True) to replace it"
    )


def _bar(plan: Plan, done: int, progress: bool | None) -> Any:
    from tqdm import tqdm

    show = progress if progress is not None else sys.stderr.isatty()
    return tqdm(total=len(plan.order), initial=done, unit="img", disable=not show, desc="pack", smoothing=0.1)
