"""index.json: the list of shards a reader needs before it touches one.

It lists every shard with its sample count, byte size, sha256 and (optionally) its version:
what the store changes when the object is replaced (S3's ETag, GCS's generation), which
readers check so that a shard replaced under its name is caught at its first read. Plus
totals, field names, class names and the files the packer skipped. Versioned: a reader
refuses an index from a newer format loudly instead of misreading it.

- Version 2 (written since shardkit 0.2): a tar dataset's per-sample byte offsets live in a
  binary offsets file beside index.json (offsets.py), named under "offsets", so index.json grows
  with the shards only (~150 bytes a shard) and reading it never touches a sample.
- Version 1: each shard entry holds its "offsets" list. Still read; `shardkit index
  --upgrade` rewrites it as version 2.

A shard entry's fields that this version does not know are kept as they are.
"""

from __future__ import annotations

import builtins
import json
import warnings
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import orjson

from .. import formats
from ..errors import CorruptShardError, IndexVersionError
from . import offsets

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # tar shards in a folder, by name (gzip is told by its first bytes)
INDEX_NAME = "index.json"
PROGRESS_DIR = ".shardkit-progress"  # a tar pack's records of finished shards, until index.json commits
FORMAT = "shardkit"
VERSION = 2
READS = (1, 2)  # the versions this shardkit reads
_PER_SAMPLE = ("keys", "sizes")  # an LMDB index's per-sample lists, in `extra`
_SHARD_KEYS = {"name", "samples", "bytes", "sha256", "offsets", "compression", "version"}


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
    version: dict[str, Any] | None = field(default=None, hash=False)  # storage.files.pin_of's: {"etag": ...}
    extra: tuple[tuple[str, Any], ...] = field(default=(), hash=False)  # fields of the entry not named above

    def __post_init__(self) -> None:
        if self.samples < 0 or self.bytes < 0:
            raise CorruptShardError(f"{self.name}: index lists {self.samples} samples of {self.bytes} bytes")
        if self.compression not in (None, "gzip"):
            raise CorruptShardError(
                f"{self.name}: index lists compression {self.compression!r}, this shardkit reads gzip only"
            )
        if self.offsets is None:
            return
        if not (isinstance(self.offsets, array) and self.offsets.typecode == "q"):
            object.__setattr__(self, "offsets", array("q", self.offsets))
        if len(self.offsets) != self.samples + 1:
            raise CorruptShardError(f"{self.name}: index lists {len(self.offsets)} offsets for {self.samples} samples")
        size = None if self.compression else self.bytes  # the inflated tar's size is not recorded
        _check_offsets(self.name, np.asarray(self.offsets, dtype=np.int64), size)

    def __repr__(self) -> str:  # the offsets by their count: a shard's repr printed every one
        offsets = None if self.offsets is None else f"<{len(self.offsets)} offsets>"
        return (
            f"ShardInfo(name={self.name!r}, samples={self.samples}, bytes={self.bytes}, sha256={self.sha256!r}, "
            f"offsets={offsets!s})"
        )

    def to_json(self, offsets: bool = False) -> dict[str, Any]:
        """The entry of index.json; with `offsets`, as version 1 wrote it (offsets inside)."""
        out: dict[str, Any] = {"name": self.name, "samples": self.samples, "bytes": self.bytes}
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        if self.compression is not None:
            out["compression"] = self.compression
        if self.version is not None:
            out["version"] = self.version
        if offsets and self.offsets is not None:
            out["offsets"] = list(self.offsets)
        return {**out, **dict(self.extra)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShardInfo:
        return cls(
            name=d["name"],
            samples=int(d["samples"]),
            bytes=int(d["bytes"]),
            sha256=d.get("sha256"),
            offsets=d.get("offsets"),
            compression=d.get("compression"),
            version=_version(d.get("version"), d["name"]),
            extra=() if d.keys() <= _SHARD_KEYS else tuple((k, v) for k, v in d.items() if k not in _SHARD_KEYS),
        )


def _version(found: Any, name: str) -> dict[str, Any] | None:
    if found is not None and not (
        isinstance(found, dict) and len(found) == 1 and isinstance(next(iter(found.values())), (str, int))
    ):
        raise CorruptShardError(f'{name}: index lists version {found!r}, not one mark such as {{"etag": ...}}')
    return found


def _check_offsets(name: str, table: np.ndarray, size: int | None) -> None:
    """Offsets that could not come from a shard of `size` bytes (None: any size) fail here,
    when the index is read, rather than as a confusing read error in a worker halfway
    through an epoch."""
    if table[0] < 0 or (size is not None and table[-1] > size):
        raise CorruptShardError(
            f"{name}: index offsets run from {table[0]} to {table[-1]}, outside the shard's {size} bytes"
        )
    bad = np.flatnonzero(table[1:] <= table[:-1])
    if len(bad):
        i = int(bad[0])
        raise CorruptShardError(f"{name}: index offsets do not increase at sample {i} ({table[i]} then {table[i + 1]})")


@dataclass(frozen=True)
class Skipped:
    """A source file the packer could not use, and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class OffsetsFile:
    """Where an index of version 2 keeps its sample offsets: a file of the dataset's folder
    (`folder`: where the index was read from, not saved)."""

    file: str
    sha256: str
    folder: str = field(default="", compare=False)


@dataclass(frozen=True)
class Index:
    shards: tuple[ShardInfo, ...]
    kind: str = formats.DEFAULT
    fields: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    plan: str | None = None  # fingerprint of the pack plan: a rerun with the same plan is a no-op
    extra: dict[str, Any] = field(default_factory=dict)
    offsets_file: OffsetsFile | None = None  # version 2: the file of the shards' offsets (else in the shards, or none)

    @property
    def sidecar(self) -> OffsetsFile | None:
        """The old name of `offsets_file` (a "sidecar" is now an image's companion file)."""
        warnings.warn("Index.sidecar is deprecated: use Index.offsets_file", DeprecationWarning, stacklevel=2)
        return self.offsets_file

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
        shards = tuple(s if s.offsets is None else replace(s, offsets=None) for s in self.shards)
        return replace(self, shards=shards, extra={k: v for k, v in self.extra.items() if k not in _PER_SAMPLE})

    def to_json(self) -> str:
        """index.json's text: version 2 (the shards' offsets in the offsets file, see `save`), or
        version 1 for an index whose shards carry their offsets (read from one, or scanned)."""
        inline = self.offsets_file is None and any(s.offsets is not None for s in self.shards)
        doc = {
            "format": FORMAT,
            "version": 1 if inline else VERSION,
            "kind": self.kind,
            "samples": self.samples,
            "bytes": self.bytes,
            "fields": list(self.fields),
            "classes": list(self.classes),
            "plan": self.plan,
            "skipped": [{"path": s.path, "reason": s.reason} for s in self.skipped],
            **self.extra,
            **(
                {"offsets": {"file": self.offsets_file.file, "sha256": self.offsets_file.sha256}}
                if self.offsets_file
                else {}
            ),
            "shards": [s.to_json(inline) for s in self.shards],
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
        if version not in READS:
            raise IndexVersionError(
                f"{where}: index version {version!r}, this shardkit reads versions {READS[0]} to {READS[-1]}; "
                "upgrade shardkit"
            )
        kind = formats.get(doc.get("kind", formats.DEFAULT), where).name
        known = {
            "format",
            "version",
            "kind",
            "samples",
            "bytes",
            "fields",
            "classes",
            "plan",
            "skipped",
            "shards",
            "offsets",
        }
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
                kind=kind,
                fields=tuple(doc.get("fields", ())),
                classes=tuple(doc.get("classes", ())),
                skipped=tuple(Skipped(s["path"], s["reason"]) for s in doc.get("skipped", ())),
                plan=doc.get("plan"),
                extra={k: v for k, v in doc.items() if k not in known},
                offsets_file=_offsets_file(doc, where) if version >= 2 else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            if isinstance(e, CorruptShardError):  # a shard entry that contradicts itself
                raise CorruptShardError(f"{where}: {e}") from None
            raise CorruptShardError(f"{where}: malformed index ({type(e).__name__}: {e})") from None
        check_names(index, where)
        if doc.get("samples") is not None and doc["samples"] != index.samples:
            raise CorruptShardError(f"{where}: total {doc['samples']} samples but shards add up to {index.samples}")
        if not formats.get(kind).sharded:
            _check_keyed(index, where)
        return index


def _offsets_file(doc: dict[str, Any], where: str) -> OffsetsFile | None:
    """The "offsets" entry of a version 2 index: a file of the dataset's folder."""
    entry = doc.get("offsets")
    if entry is None:
        if formats.get(doc.get("kind", formats.DEFAULT)).sharded:
            raise CorruptShardError(f"{where}: a version 2 index of tar shards names no file of sample offsets")
        return None
    if any(s.get("offsets") is not None for s in doc["shards"]):
        raise CorruptShardError(f"{where}: lists sample offsets both in its shards and in {entry.get('file')!r}")
    name, sha = entry["file"], entry["sha256"]
    if not (isinstance(name, str) and offsets.PATTERN.match(name) and isinstance(sha, str)):
        raise CorruptShardError(f'{where}: "offsets" names {name!r}, not a shardkit offsets file of the folder')
    return OffsetsFile(name, sha)


def check_names(index: Index, where: str) -> None:
    """Shards are files of the dataset's folder, each listed once: a name with a folder in it
    (`../x.tar`) would be read from elsewhere, a name listed twice read twice."""
    names = [s.name for s in index.shards]
    if len(set(names)) == len(names) and all(type(n) is str for n in names):
        text = "\n".join(names)  # one look for a bad character in them all
        if "/" not in text and "\0" not in text and not {"", ".", ".."} & set(names):
            return
    seen: set[str] = set()
    for name in names:
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name:
            raise CorruptShardError(f"{where}: shard name {name!r} is not the name of a file in the dataset's folder")
        if name in seen:
            raise CorruptShardError(f"{where}: shard {name!r} is listed twice")
        seen.add(name)


def _check_keyed(index: Index, where: str) -> None:
    """An LMDB's index is one `data.mdb` shard and a key (and a size) for every sample."""
    keys, sizes = index.extra.get("keys"), index.extra.get("sizes")
    if len(index.shards) != 1:
        raise CorruptShardError(f"{where}: an LMDB index lists {len(index.shards)} shards, not the one data.mdb")
    if not isinstance(keys, list) or len(keys) != index.samples:
        raise CorruptShardError(
            f"{where}: an LMDB index needs a key for each of its {index.samples} samples, "
            f"it lists {len(keys) if isinstance(keys, list) else 'no list of'} keys"
        )
    if sizes is not None and (not isinstance(sizes, list) or len(sizes) != len(keys)):
        raise CorruptShardError(
            f"{where}: an LMDB index lists {len(sizes) if isinstance(sizes, list) else 'no list of'} "
            f"sizes for {len(keys)} keys"
        )
    bad = next((i for i, k in enumerate(keys) if not isinstance(k, str) or not k or "\0" in k), None)
    if bad is not None:  # a NUL: numpy's bytes table would cut the key there and read another record
        raise CorruptShardError(f"{where}: LMDB key {bad} is {keys[bad]!r}, not a sample key (a non-empty string)")
    bad = next((i for i, n in enumerate(sizes or ()) if type(n) is not int or n < 0), None)
    if bad is not None and sizes is not None:
        raise CorruptShardError(f"{where}: LMDB size {bad} is {sizes[bad]!r}, not a size in bytes")
