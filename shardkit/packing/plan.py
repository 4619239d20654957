"""The pack plan: scan the source once, order it (shuffled by a seed for image folders),
and cut it into jobs of at most `max_count` samples and `max_size` bytes. The plan is data:
a Listing in numpy arrays plus job boundaries, with a fingerprint per job so a rerun can
tell finished work from stale work. A job's items are built only when the job runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from json.encoder import encode_basestring as _json_str
from typing import overload

import numpy as np

from .. import formats, storage
from ..errors import SourceError
from ..formats.tar import BLOCK, member_size
from ..index import ShardInfo, Skipped
from ..storage import StorageOptions
from . import sidecars
from .inputs import IMAGES, Scanned, identify
from .inputs.folder import HIDDEN
from .listing import Item, Listing
from ..units import parse_size

DEFAULT_MAX_SIZE = "256MB"
DEFAULT_MAX_FILE_SIZE = 1 << 30  # a source file larger is skipped unread (a 2 GB sparse .jpg)
META, META_ASIDE = "json", "shardkit.json"  # shardkit's record of a sample; aside where the samples bring a json


@dataclass(frozen=True)
class Options:
    """How the jobs run: what shapes the bytes of a shard (part of every job's fingerprint),
    and `on_error`."""

    resize: int | None = None
    quality: int | None = None
    on_error: str = "skip"
    decode_check: bool = False  # decode every image in full, so a corrupt one is skipped at pack time
    max_file_size: int | None = DEFAULT_MAX_FILE_SIZE  # bytes of a source image file; larger: skipped unread


@dataclass(frozen=True)
class Job:
    name: str
    src: str
    dest: str
    items: tuple[Item, ...]
    classes: tuple[str, ...]
    options: Options
    fingerprint: str
    storage_options: StorageOptions | None = field(default=None, repr=False)  # credentials: never shown
    input_kind: str = IMAGES  # or a format's name: a dataset being converted
    shards: tuple[ShardInfo, ...] = ()  # a tar source's index entries of the shards the items come from
    run: str = ""  # this pack call's id: what a worker learns about source shards holds for one run
    meta: str = META  # the field of shardkit's record of a sample's class and path
    source_goes_on: bool = False  # the next job begins in the source shard this one ends in


@dataclass(frozen=True)
class Plan:
    """The jobs, kept compact: a Listing, the order to take it in, and where each job's run
    of that order starts and stops. `job(i)` builds job i's items only when it is needed."""

    src: str
    dest: str
    input_kind: str
    classes: tuple[str, ...]
    skipped: tuple[Skipped, ...]
    listing: Listing
    order: np.ndarray
    bounds: tuple[tuple[int, int], ...]
    names: tuple[str, ...]
    options: Options
    storage_options: StorageOptions | None = field(repr=False)  # credentials: never shown
    fingerprints: tuple[str, ...] = ()
    fingerprint: str = ""
    inherited: tuple[Skipped, ...] = ()  # a converted dataset's own list of what its pack skipped
    shards: tuple[ShardInfo, ...] = ()  # a tar source's index entries
    run: str = ""
    meta: str = META

    def items(self, i: int) -> tuple[Item, ...]:
        lo, hi = self.bounds[i]
        width = max(6, len(str(len(self.order) - 1)))
        out = []
        for position in range(lo, hi):
            item = self.listing.item(int(self.order[position]))
            if self.input_kind == IMAGES:  # a new sample number; conversions keep their keys
                item = item._replace(key=f"{position:0{width}d}")
            elif (fmt := _converted(self.input_kind)) and not fmt.sharded:  # the path is its key
                item = item._replace(key=item.path)
            out.append(item)
        return tuple(out)

    def job(self, i: int, then: int | None = None) -> Job:
        """Job i; `then`: the job run after it (None: none), to tell whether that one goes on
        in the source shard this one ends in."""
        fp = self.fingerprints[i] if self.fingerprints else ""
        items = self.items(i)
        shards: tuple[ShardInfo, ...] = ()
        goes_on = False
        if (fmt := _converted(self.input_kind)) and fmt.sharded:
            names = dict.fromkeys(_shard_of(it) for it in items)
            shards = tuple(
                replace(s, offsets=None) if s.sha256 else s  # a hash checks them
                for s in map(self._shard.__getitem__, names)
            )
            if items and then == i + 1 and self.size(then):
                goes_on = _shard_of(self.listing.item(int(self.order[self.bounds[then][0]]))) == _shard_of(items[-1])
        return Job(
            self.names[i],
            self.src,
            self.dest,
            items,
            self.classes,
            self.options,
            fp,
            self.storage_options,
            self.input_kind,
            shards,
            self.run,
            self.meta,
            goes_on,
        )

    @functools.cached_property
    def _shard(self) -> dict[str, ShardInfo]:
        return {info.name: info for info in self.shards}

    def size(self, i: int) -> int:
        return self.bounds[i][1] - self.bounds[i][0]


class JobList(Sequence[Job]):
    """Jobs of a plan to run, in order, built one at a time as they are taken."""

    def __init__(self, plan: Plan, indices: Sequence[int]):
        self._plan, self._indices = plan, list(indices)

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, i: int) -> Job: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Job]: ...

    def __getitem__(self, i: int | slice) -> Job | Sequence[Job]:
        if isinstance(i, slice):
            return JobList(self._plan, self._indices[i])
        i = range(len(self._indices))[i]
        return self._plan.job(self._indices[i], self._indices[i + 1] if i + 1 < len(self._indices) else None)


def _shard_of(item: Item) -> str:
    """The source shard of a converted sample ("SHARD@START:END")."""
    return item.path.rpartition("@")[0]


def sample_meta(item: Item, classes: tuple[str, ...]) -> bytes:
    """`{"class":...,"path":...}` (`{"path":...}` for a sample without a class name): compact,
    keys sorted, UTF-8 (what json.dumps would give)."""
    if classes and item.label >= 0:
        return f'{{"class":{_json_str(classes[item.label])},"path":{_json_str(item.path)}}}'.encode()
    return f'{{"path":{_json_str(item.path)}}}'.encode()


def _fingerprint(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _even_cuts(needs: np.ndarray, max_count: int | None, limit: int | None) -> tuple[tuple[int, int], ...]:
    """Cut items into the fewest jobs that respect both caps, as even as possible (a small
    last shard would leave a worker idle while the others finish). Falls back to filling
    greedily when very uneven items make even cuts break a cap."""
    n_items, total = len(needs), int(needs.sum())
    if n_items == 0:
        return ((0, 0),)
    fewest = max(1, -(-n_items // max_count) if max_count else 1, -(-total // limit) if limit else 1)
    by_count = bool(max_count) and (not limit or -(-n_items // max_count) >= -(-total // limit))  # type: ignore[operator]  # max_count is set when by_count
    for count in range(fewest, min(fewest + 3, n_items + 1)):
        if by_count:
            edges = (np.arange(count + 1) * n_items) // count
        else:  # cut where the running total crosses each multiple of total / count
            starts = np.cumsum(needs) - needs
            edges = np.append(np.searchsorted(starts, np.arange(count) * total / count, side="left"), n_items)
        counts = np.diff(edges)
        if (counts == 0).any():
            continue
        sizes = np.add.reduceat(needs, edges[:-1])
        if (not max_count or counts.max() <= max_count) and (not limit or (sizes[counts > 1] <= limit).all()):
            return tuple((int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]))
    bounds, start, size = [], 0, 0
    for position, need in enumerate(needs.tolist()):
        count = position - start
        if count and ((max_count is not None and count >= max_count) or (limit is not None and size + need > limit)):
            bounds.append((start, position))
            start, size = position, 0
        size += need
    bounds.append((start, n_items))
    return tuple(bounds)


def make_plan(
    src: str,
    dest: str,
    *,
    max_count: int | None = None,
    max_size: int | str | None = DEFAULT_MAX_SIZE,
    shuffle: bool = True,
    seed: int = 0,
    options: Options = Options(),
    fmt: str = formats.DEFAULT,
    job_name: str = "shard-{:06d}.tar",
    payload: Callable[[int], int] = lambda limit: limit,
    storage_options: StorageOptions | None = None,
    layout: str = "classes",
    fields: Sequence[str] = (),
) -> Plan:
    """Scan SRC and cut its samples into jobs. A dataset being converted keeps its order
    and keys (shuffle applies to image folders and manifests only, whose samples are
    numbered anew). `layout` and `fields` (sidecar fields besides the defaults) are an image
    folder's; a manifest's items are read from its folder."""
    scanned = _scanned(src, storage_options, options, layout, sidecars.check_fields(fields))
    src, input_kind, classes, listing, skipped = (
        scanned.src,
        scanned.input_kind,
        scanned.classes,
        scanned.listing,
        scanned.skipped,
    )
    idx = scanned.converted  # a dataset converted keeps its order
    if idx is None:
        order = np.random.default_rng(seed).permutation(len(listing)) if shuffle else np.arange(len(listing))
    else:
        order = np.arange(len(listing))
    converted_id = None if idx is None else _fingerprint(idx.to_json())
    inherited = () if idx is None else idx.skipped
    shards = idx.shards if idx is not None and formats.get(input_kind).sharded else ()
    limit = parse_size(max_size) if max_size is not None else None
    if limit is not None:  # the members' share of a job's bytes (the format's own overhead aside)
        limit = payload(limit)
    needs = _needs(listing, input_kind, classes)[order]
    bounds = _even_cuts(needs, max_count, limit)
    names = tuple(job_name.format(i) for i in range(len(bounds)))
    meta = META_ASIDE if META in listing.extra_fields else META
    plan = Plan(
        src,
        dest,
        input_kind,
        classes,
        skipped,
        listing,
        order,
        tuple(bounds),
        names,
        options,
        storage_options,
        meta=meta,
    )
    fingerprints = tuple(_job_fingerprint(plan, i, converted_id) for i in range(len(bounds)))
    # what the scan left out is part of the index, so of what makes this pack the same as
    # another; hidden entries (.DS_Store) are not, and with nothing else left out the
    # fingerprint is what it was before it counted them, so older packs still match
    left_out = [asdict(s) for s in skipped if s.reason != HIDDEN]
    fingerprint = _fingerprint(fmt, classes, fingerprints, *([left_out] if left_out else []))
    return replace(
        plan,
        fingerprints=fingerprints,
        fingerprint=fingerprint,
        inherited=inherited,
        shards=shards,
        run=os.urandom(8).hex(),
    )


def _scanned(
    src: str, storage_options: StorageOptions | None, options: Options, layout: str, fields: tuple[str, ...]
) -> Scanned:
    """SRC scanned by the input kind that claims it, once the options are known to apply to it."""
    kind, named = identify(src, storage_options)
    if not kind.shaped and (layout != "classes" or set(fields) != set(sidecars.DEFAULT_FIELDS)):
        raise SourceError(f"{storage.display(src)}: a {named}: layout and fields describe an image folder")
    if kind.converts and (options.resize or options.quality):
        raise SourceError(
            f"{storage.display(src)}: a {named} dataset, converted byte for byte; resize and "
            "quality re-encode the images of an image folder (pack the folder itself)"
        )
    return kind.scan(src, storage_options, layout, fields)


def _converted(input_kind: str) -> formats.Format | None:
    """The format of the dataset a plan converts (None: images to pack)."""
    return None if input_kind == IMAGES else formats.get(input_kind)


def _needs(listing: Listing, input_kind: str, classes: tuple[str, ...]) -> np.ndarray:
    """The bytes each item takes in a tar shard, from the listing's arrays."""
    if (fmt := _converted(input_kind)) is not None:
        if fmt.sharded:  # a sample's whole byte range
            return listing.sizes
        return listing.sizes + 6 * BLOCK  # member payloads: add the tar headers and padding
    # a folder: the image (copied as is), `cls` and `json` (sample_meta) members, exactly, and the extras
    path_bytes = np.diff(listing.ends, prepend=0)
    if _JSON_ESCAPED.search(listing.paths):  # rare: measure the escaped paths one by one
        path_json = np.array([len(_json_str(listing.item(i).path).encode()) for i in range(len(listing))], np.int64)
    else:
        path_json = path_bytes + 2
    labels, labelled = listing.labels, listing.labels >= 0
    meta = len('{"path":}') + path_json
    if classes:
        class_json = np.array([len(_json_str(c).encode()) for c in classes], np.int64)
        meta += np.where(labelled, len('"class":,') + class_json[np.where(labelled, labels, 0)], 0)
    digits = 1 + np.searchsorted(10 ** np.arange(1, 19, dtype=np.int64), labels, side="right")
    cls = np.where(labelled, member_size(digits), 0)
    extras = listing.extra_sizes if listing.extra_sizes is not None else 0
    return np.asarray(member_size(listing.sizes) + cls + member_size(meta) + extras)


_JSON_ESCAPED = re.compile(rb'["\\\x00-\x1f]')  # what json escapes in a str: quote, backslash, controls


def _job_fingerprint(plan: Plan, i: int, converted_id: str | None) -> str:
    """What job i's shard is made of: its name, keys, options, and every item's path, class,
    size and modification time. A rerun reuses the shard only if all of them are unchanged."""
    lo, hi = plan.bounds[i]
    listing, ids = plan.listing, plan.order[lo:hi]
    starts = np.where(ids > 0, listing.ends[ids - 1], 0).tolist()  # this job's items only, not the listing
    # on_error decides whether a pack goes on past a bad file, not what a shard holds: a shard
    # written under "raise" is the one "skip" writes (kept under "raise" only if it skipped nothing)
    options = asdict(replace(plan.options, on_error="skip"))
    if not options["decode_check"]:  # absent when off: packs made before the option still match
        del options["decode_check"]
    if options["max_file_size"] == DEFAULT_MAX_FILE_SIZE:  # absent at its default, as for decode_check
        del options["max_file_size"]
    h = hashlib.sha256(
        json.dumps(
            [plan.names[i], plan.input_kind, plan.classes, options, converted_id, lo, hi, len(plan.order)]
        ).encode()
    )
    for column in (ids, listing.labels[ids], listing.sizes[ids], listing.mtimes[ids]):
        h.update(np.ascontiguousarray(column, "<i8").tobytes())
    h.update(b"\0".join(listing.paths[a:b] for a, b in zip(starts, listing.ends[ids].tolist())))
    ends, sizes = listing.extra_ends, listing.extra_sizes
    if ends is not None and sizes is not None:  # sidecars and values: absent before them, so older packs still match
        h.update(json.dumps([plan.meta, sizes[ids].tolist()]).encode())
        h.update(
            b"\0".join(
                listing.extras[a:b] for a, b in zip(np.where(ids > 0, ends[ids - 1], 0).tolist(), ends[ids].tolist())
            )
        )
    return h.hexdigest()
