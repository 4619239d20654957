"""index.json: the manifest a reader needs before it touches a shard.

It lists every shard with its sample count, byte size, sha256, per-sample byte offsets and
(optionally) its version: what the store changes when the object is replaced (S3's ETag, GCS's
generation, a file's modification time), which readers check so that a shard replaced under
its name is caught at its first read. Plus totals, field names, class names and the files the packer skipped. Versioned: a reader
refuses an index from a newer format loudly instead of misreading it.
"""

from __future__ import annotations

import builtins
import json
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson

from . import storage
from .errors import CorruptShardError, DatasetNotFoundError, IndexVersionError, ShardkitError, UnfinishedPackError
from .storage import StorageOptions

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # tar shards in a folder, by name (gzip is told by its first bytes)
LMDB_DATA_FILE = "data.mdb"  # the lmdb library's name for its data file: a folder holding one is an LMDB
INDEX_NAME = "index.json"
PROGRESS_DIR = ".shardkit-progress"  # a tar pack's records of finished shards, until index.json commits
FORMAT = "shardkit"
VERSION = 1
_PER_SAMPLE = ("keys", "sizes")  # an LMDB index's per-sample lists, in `extra`


@dataclass(frozen=True)
class ShardInfo:
    """One shard. `offsets` has samples + 1 entries: sample i is bytes [offsets[i], offsets[i+1]).
    They are kept as an `array("q")`: 8 bytes a sample, where a tuple of ints takes ~40.
    A `compression` ("gzip") shard is a stream: its offsets are in the tar inside, `bytes`
    and `sha256` are the compressed file's."""

    name: str
    samples: int
    bytes: int
    sha256: str | None = None
    offsets: Sequence[int] | None = field(default=None, hash=False)
    compression: str | None = None
    version: dict[str, Any] | None = field(default=None, hash=False)  # storage.pin_of's: {"etag": ...}

    def __post_init__(self) -> None:
        if self.samples < 0 or self.bytes < 0:
            raise CorruptShardError(f"{self.name}: index lists {self.samples} samples of {self.bytes} bytes")
        if self.compression not in (None, "gzip"):
            raise CorruptShardError(f"{self.name}: index lists compression {self.compression!r}, this shardkit reads "
                                    "gzip only")
        if self.offsets is None:
            return
        if not (isinstance(self.offsets, array) and self.offsets.typecode == "q"):
            object.__setattr__(self, "offsets", array("q", self.offsets))
        if len(self.offsets) != self.samples + 1:
            raise CorruptShardError(
                f"{self.name}: index lists {len(self.offsets)} offsets for {self.samples} samples"
            )
        size = None if self.compression else self.bytes  # the inflated tar's size is not recorded
        _check_offsets(self.name, np.asarray(self.offsets, dtype=np.int64), size)

    def __repr__(self) -> str:  # the offsets by their count: a shard's repr printed every one
        offsets = None if self.offsets is None else f"<{len(self.offsets)} offsets>"
        return (f"ShardInfo(name={self.name!r}, samples={self.samples}, bytes={self.bytes}, sha256={self.sha256!r}, "
                f"offsets={offsets!s})")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "samples": self.samples, "bytes": self.bytes}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.compression is not None:
            out["compression"] = self.compression
        if self.version is not None:
            out["version"] = self.version
        if self.offsets is not None:
            out["offsets"] = list(self.offsets)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardInfo:
        offsets = d.get("offsets")
        return cls(
            name=d["name"],
            samples=int(d["samples"]),
            bytes=int(d["bytes"]),
            sha256=d.get("sha256"),
            offsets=offsets,
            compression=d.get("compression"),
            version=_version(d.get("version"), d["name"]),
        )


def _version(found: Any, name: str) -> dict[str, Any] | None:
    if found is not None and not (isinstance(found, dict) and len(found) == 1
                                  and isinstance(next(iter(found.values())), (str, int))):
        raise CorruptShardError(f"{name}: index lists version {found!r}, not one mark such as {{\"etag\": ...}}")
    return found


def pinned(index: Index, url: str, storage_options: StorageOptions | None = None) -> Index:
    """`index` with each shard's current version (one listing of the dataset's folder), for
    readers to check; a tar index only (an LMDB is read from a local copy)."""
    if index.kind != "tar":
        return index
    found = storage.pins(url, [s.name for s in index.shards], storage_options)
    return replace(index, shards=tuple(replace(s, version=v) for s, v in zip(index.shards, found)))


def _check_offsets(name: str, table: np.ndarray, size: int | None) -> None:
    """Offsets that could not come from a shard of `size` bytes (None: any size) fail here,
    when the index is read, rather than as a confusing read error in a worker halfway
    through an epoch."""
    if table[0] < 0 or (size is not None and table[-1] > size):
        raise CorruptShardError(f"{name}: index offsets run from {table[0]} to {table[-1]}, outside the shard's "
                                f"{size} bytes")
    bad = np.flatnonzero(table[1:] <= table[:-1])
    if len(bad):
        i = int(bad[0])
        raise CorruptShardError(f"{name}: index offsets do not increase at sample {i} "
                                f"({table[i]} then {table[i + 1]})")


@dataclass(frozen=True)
class Skipped:
    """A source file the packer could not use, and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class Index:
    shards: tuple[ShardInfo, ...]
    kind: str = "tar"
    fields: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    plan: str | None = None  # fingerprint of the pack plan: a rerun with the same plan is a no-op
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def slim(self) -> Index:
        """This index without its per-sample tables (tar offsets, LMDB keys and sizes), for a
        reader that keeps what it needs of them as numpy arrays: held twice they would cost
        every rank, and each spawned worker's pickle, as much again. Not for saving: a reader
        refuses an index without offsets."""
        return replace(self, shards=tuple(replace(s, offsets=None) for s in self.shards),
                       extra={k: v for k, v in self.extra.items() if k not in _PER_SAMPLE})

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "samples": self.samples,
            "bytes": self.bytes,
            "fields": list(self.fields),
            "classes": list(self.classes),
            "plan": self.plan,
            "skipped": [{"path": s.path, "reason": s.reason} for s in self.skipped],
            **self.extra,
            "shards": [s.to_json() for s in self.shards],
        }
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str | builtins.bytes, where: str = INDEX_NAME) -> Index:  # (bytes: Index.bytes here)
        try:
            doc = orjson.loads(text)  # ~3x json's speed on the offsets of millions of samples
        except ValueError as e:
            raise CorruptShardError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptShardError(f"{where}: not a shardkit index")
        version = doc.get("version")
        if version != VERSION:
            raise IndexVersionError(
                f"{where}: index version {version!r}, this shardkit reads version {VERSION}; upgrade shardkit"
            )
        known = {"format", "version", "kind", "samples", "bytes", "fields", "classes", "plan", "skipped", "shards"}
        try:
            tables = [array("q", s.pop("offsets")) if s.get("offsets") is not None else None for s in doc["shards"]]
            if any(t is not None for t in tables):
                # What the index keeps of the parse (names, sha256s) sits among the parsed
                # offsets' int objects and would keep their memory from going back to the
                # system (~30 bytes a sample, for good): keep a fresh copy of the small rest.
                doc = orjson.loads(orjson.dumps(doc))
            for s, table in zip(doc["shards"], tables):
                s["offsets"] = table
            index = cls(
                shards=tuple(ShardInfo.from_json(s) for s in doc["shards"]),
                kind=doc.get("kind", "tar"),
                fields=tuple(doc.get("fields", ())),
                classes=tuple(doc.get("classes", ())),
                skipped=tuple(Skipped(s["path"], s["reason"]) for s in doc.get("skipped", ())),
                plan=doc.get("plan"),
                extra={k: v for k, v in doc.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            if isinstance(e, CorruptShardError):  # a shard entry that contradicts itself
                raise CorruptShardError(f"{where}: {e}") from None
            raise CorruptShardError(f"{where}: malformed index ({type(e).__name__}: {e})") from None
        _check_names(index, where)
        if doc.get("samples") is not None and doc["samples"] != index.samples:
            raise CorruptShardError(f"{where}: total {doc['samples']} samples but shards add up to {index.samples}")
        if index.kind == "lmdb":
            _check_lmdb(index, where)
        return index


def _check_names(index: Index, where: str) -> None:
    """Shards are files of the dataset's folder, each listed once: a name with a folder in it
    (`../x.tar`) would be read from elsewhere, a name listed twice read twice."""
    seen: set[str] = set()
    for s in index.shards:
        if not isinstance(s.name, str) or s.name in ("", ".", "..") or "/" in s.name or "\0" in s.name:
            raise CorruptShardError(f"{where}: shard name {s.name!r} is not the name of a file in the dataset's folder")
        if s.name in seen:
            raise CorruptShardError(f"{where}: shard {s.name!r} is listed twice")
        seen.add(s.name)


def _check_lmdb(index: Index, where: str) -> None:
    """An LMDB's index is one `data.mdb` shard and a key (and a size) for every sample."""
    keys, sizes = index.extra.get("keys"), index.extra.get("sizes")
    if len(index.shards) != 1:
        raise CorruptShardError(f"{where}: an LMDB index lists {len(index.shards)} shards, not the one data.mdb")
    if not isinstance(keys, list) or len(keys) != index.samples:
        raise CorruptShardError(f"{where}: an LMDB index needs a key for each of its {index.samples} samples, "
                                f"it lists {len(keys) if isinstance(keys, list) else 'no list of'} keys")
    if sizes is not None and (not isinstance(sizes, list) or len(sizes) != len(keys)):
        raise CorruptShardError(f"{where}: an LMDB index lists {len(sizes) if isinstance(sizes, list) else 'no list of'} "
                                f"sizes for {len(keys)} keys")
    bad = next((i for i, k in enumerate(keys) if not isinstance(k, str) or not k or "\0" in k), None)
    if bad is not None:  # a NUL: numpy's bytes table would cut the key there and read another record
        raise CorruptShardError(f"{where}: LMDB key {bad} is {keys[bad]!r}, not a sample key (a non-empty string)")
    bad = next((i for i, n in enumerate(sizes or ()) if type(n) is not int or n < 0), None)
    if bad is not None and sizes is not None:
        raise CorruptShardError(f"{where}: LMDB size {bad} is {sizes[bad]!r}, not a size in bytes")


def find(url: str, storage_options: StorageOptions | None = None) -> Index | None:
    """DATASET/index.json, or None where there is none (an unfinished pack raises)."""
    where = storage.join(url, INDEX_NAME)
    try:
        text = storage.read_bytes(where, storage_options)
    except FileNotFoundError:
        check_finished(url, storage_options)
        return None
    except NotADirectoryError:
        raise DatasetNotFoundError(f"{url}: not a folder (give the dataset folder, which holds {INDEX_NAME})") from None
    return Index.from_json(text, where)


def load(url: str, storage_options: StorageOptions | None = None) -> Index:
    """Read DATASET/index.json; where there is none, say what the folder may be instead."""
    found = find(url, storage_options)
    if found is None and storage.is_local(url) and not os.path.isdir(storage.local_path(url)):
        raise DatasetNotFoundError(f"{url}: no such folder")  # the readers' words for it
    if found is None:
        raise DatasetNotFoundError(f"{storage.join(url, INDEX_NAME)}: no such index ({_guess(url, storage_options)})")
    return found


def check_finished(url: str, storage_options: StorageOptions | None = None) -> None:
    """Raise UnfinishedPackError where a pack into `url` has started and not finished: its
    shards must not be read (or indexed) as if they were a dataset."""
    if storage.exists(storage.join(url, PROGRESS_DIR), storage_options):
        raise UnfinishedPackError(f"{storage.join(url, INDEX_NAME)}: not written yet: a pack into "
                                  f"{storage.display(url)} has not finished (rerun the same `shardkit pack` to finish it)")


def _guess(url: str, storage_options: StorageOptions | None) -> str:
    """What a folder without index.json may be, by its listing (asked only on that failure)."""
    try:
        names = storage.listdir(url, storage_options)
    except (OSError, ShardkitError):
        names = []
    if LMDB_DATA_FILE in names:
        return "an LMDB pack that has not finished, or whose index.json was removed: rerun the same `shardkit pack`"
    if any(n.endswith(SHARD_SUFFIXES) for n in names):
        return f"tar shards from another tool: `shardkit index {storage.display(url)}` writes one"
    return "not a shardkit dataset?"


def save(index: Index, url: str, storage_options: StorageOptions | None = None) -> None:
    """Write DATASET/index.json atomically (one that a reader would refuse is refused here)."""
    _check_names(index, storage.join(url, INDEX_NAME))
    storage.write_bytes_atomic(storage.join(url, INDEX_NAME), index.to_json().encode(), storage_options)
