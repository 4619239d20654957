"""What a pack reads: an ImageFolder tree, or an existing shardkit dataset (tar or LMDB) to
convert. Either way the result is a Listing of items in a deterministic order; nothing here
reads image bytes.

A Listing keeps its items in numpy arrays and one bytes blob of paths (about 70 bytes per
file), not as Python objects (about 450 bytes each): a million files cost ~70 MB to plan.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import images
from .. import index, storage
from ..errors import SourceError, about_the_file
from ..formats import lmdb as lmdb_format
from ..index import Index, Skipped
from ..storage import StorageOptions

HIDDEN = "hidden entry ignored"  # listed in the index, but not a failure under on_error="fail"


class Item(NamedTuple):
    key: str  # output sample key ("" keeps the source's own key)
    path: str  # folder: path relative to SRC, '/'-separated; tar: "SHARD@START:END"; lmdb: the key
    label: int  # class index (-1: the source sample carries its own)
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Listing:
    paths: bytes  # every item's path, UTF-8, back to back
    ends: np.ndarray  # where each path ends in `paths`
    labels: np.ndarray
    sizes: np.ndarray
    mtimes: np.ndarray

    def __len__(self) -> int:
        return len(self.ends)

    def item(self, i: int, key: str = "") -> Item:
        start = int(self.ends[i - 1]) if i else 0
        path = self.paths[start : int(self.ends[i])].decode("utf-8")
        return Item(key, path, int(self.labels[i]), int(self.sizes[i]), int(self.mtimes[i]))


class _ListingBuilder:
    def __init__(self) -> None:
        self.paths = bytearray()
        self.ends, self.labels, self.sizes, self.mtimes = array("q"), array("q"), array("q"), array("q")

    def add(self, path: str, label: int, size: int, mtime: int) -> None:
        self.paths += path.encode("utf-8")
        self.ends.append(len(self.paths))
        self.labels.append(label)
        self.sizes.append(size)
        self.mtimes.append(mtime)

    def build(self) -> Listing:
        return Listing(bytes(self.paths), np.frombuffer(self.ends, np.int64), np.frombuffer(self.labels, np.int64),
                       np.frombuffer(self.sizes, np.int64), np.frombuffer(self.mtimes, np.int64))


def _walk(top: str, rel: str, above: frozenset[tuple[int, int]], skipped: list[Skipped]
          ) -> Iterator[tuple[str, os.stat_result]]:
    """Yield (relpath, stat) of the files under `top`, following symlinks but never a loop
    (a folder that is one of its own ancestors). A folder reached twice by two routes is
    read twice, as torchvision's ImageFolder does. Hidden entries and names that are not
    UTF-8 (they cannot be tar member names) are skipped."""
    try:
        st = os.stat(top)
        if (st.st_dev, st.st_ino) in above:
            skipped.append(Skipped(rel + "/", "symlink loop (a folder inside itself)"))
            return
        above = above | {(st.st_dev, st.st_ino)}
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as e:
        if not about_the_file(e):
            raise
        skipped.append(Skipped(rel + "/", f"cannot list folder ({e.strerror or e})"))
        return
    for entry in entries:
        child = f"{rel}/{entry.name}"
        if not _usable_name(entry.name, child, skipped):
            continue
        try:
            if entry.is_dir():
                yield from _walk(entry.path, child, above, skipped)
            elif entry.is_file():
                yield child, entry.stat()
            elif entry.is_symlink() and not os.path.exists(entry.path):
                skipped.append(Skipped(child, "broken symlink"))
            else:
                skipped.append(Skipped(child, "not a regular file"))
        except OSError as e:
            if not about_the_file(e):
                raise
            skipped.append(Skipped(child, f"cannot stat ({e.strerror or e})"))


def _usable_name(name: str, rel: str, skipped: list[Skipped]) -> bool:
    """False (and the entry listed in `skipped`) for hidden entries and non-UTF-8 names."""
    if name.startswith("."):
        skipped.append(Skipped(rel, HIDDEN))
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode kept undecodable bytes as surrogates
        skipped.append(Skipped(os.fsencode(rel).decode("utf-8", "backslashreplace"), "file name is not valid UTF-8"))
        return False
    return True


def scan_folder(src: str, storage_options: StorageOptions | None = None) -> tuple[tuple[str, ...], Listing, list[Skipped]]:
    """Classes (sorted folder names), the image files, and what was left out."""
    if not storage.is_local(src):
        return _scan_remote(src, storage_options)
    path = storage.local_path(src)
    if not os.path.exists(path):
        raise SourceError(f"{src}: no such folder")
    if not os.path.isdir(path):
        raise SourceError(f"{src}: not a folder (expected SRC/<class>/<image>)")
    skipped: list[Skipped] = []
    classes = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if not _usable_name(entry.name, entry.name, skipped):
            continue
        if entry.is_dir():
            classes.append(entry.name)
        else:
            skipped.append(Skipped(entry.name, "not inside a class folder"))
    if not classes:
        shards = any(s.path.endswith(".tar") for s in skipped)
        hint = f"; tar shards from another tool are converted once `shardkit index {src}` has indexed them" if shards else ""
        raise SourceError(f"{src}: no class folders (expected SRC/<class>/<image>){hint}")
    found = _ListingBuilder()
    top = os.stat(path)
    above = frozenset({(top.st_dev, top.st_ino)})  # a class folder linked to SRC itself is a loop too
    for label, name in enumerate(classes):
        # by whole path, as a bucket lists them: a copy of the tree packs in the same order
        for rel, st in sorted(_walk(os.path.join(path, name), name, above, skipped), key=lambda f: f[0]):
            if images.field_for(rel) is None:
                skipped.append(Skipped(rel, "not an image file extension"))
                continue
            found.add(rel, label, st.st_size, st.st_mtime_ns)
    listing = found.build()
    if not len(listing):
        raise SourceError(f"{src}: no image files in {len(classes)} class folders")
    return tuple(classes), listing, skipped


def _scan_remote(src: str, storage_options: StorageOptions | None) -> tuple[tuple[str, ...], Listing, list[Skipped]]:
    """The same for a bucket prefix, in one recursive listing. As locally, every folder at the
    top is a class, whether it holds images or not (object stores have no empty folders)."""
    import hashlib

    root = storage.filesystem(src, storage_options)[1].rstrip("/")
    entries = storage.find(src, storage_options)
    skipped: list[Skipped] = []
    files = []
    tops = set()
    for path in sorted(entries):
        rel = path[len(root):].lstrip("/")
        top, sep, _ = rel.partition("/")
        if sep and not top.startswith("."):
            tops.add(top)
        if any(part.startswith(".") for part in rel.split("/")):
            skipped.append(Skipped(rel, HIDDEN))
        elif not sep:
            skipped.append(Skipped(rel, "not inside a class folder"))
        elif images.field_for(rel) is None:
            skipped.append(Skipped(rel, "not an image file extension"))
        else:
            files.append((top, rel, entries[path]))
    if not entries:
        raise SourceError(f"{storage.display(src)}: no such folder, or empty")
    classes = tuple(sorted(tops))
    if not classes:
        raise SourceError(f"{storage.display(src)}: no class folders (expected SRC/<class>/<image>)")
    if not files:
        raise SourceError(f"{storage.display(src)}: no image files in {len(classes)} class folders")
    found = _ListingBuilder()
    label_of = {c: i for i, c in enumerate(classes)}
    files.sort(key=lambda f: (label_of[f[0]], f[1]))  # class by class, as locally ("a-b/x" lists before "a/x")
    for top, rel, info in files:
        # object stores give no mtime in nanoseconds: any change marker will do for resume checks
        marker = str(info.get("ETag") or info.get("etag") or info.get("md5Hash") or info.get("mtime") or "")
        version = int.from_bytes(hashlib.sha256(marker.encode()).digest()[:7], "big")
        found.add(rel, label_of[top], int(info.get("size") or 0), version)
    return classes, found.build(), skipped


def source_kind(src: str, storage_options: StorageOptions | None = None) -> str:
    """"tar" or "lmdb" for a shardkit dataset, "folder" for anything else."""
    if storage.exists(storage.join(src, index.INDEX_NAME), storage_options):
        return index.load(src, storage_options).kind
    if storage.is_local(src) and lmdb_format.is_lmdb(storage.local_path(src)):
        return "lmdb"
    index.check_finished(src, storage_options)  # an unfinished pack is no image folder either
    return "folder"


def scan_dataset(src: str, kind: str, storage_options: StorageOptions | None = None) -> tuple[Index, Listing]:
    """The samples of a shardkit dataset, in its order, as items to copy byte for byte: for
    LMDB the path is the sample key, for tar "SHARD@START:END"."""
    found = _ListingBuilder()
    if kind == "lmdb":
        from ..sources import lmdb_index

        idx = index.load(src, storage_options) if storage.exists(storage.join(src, index.INDEX_NAME)) else lmdb_index(src)
        keys = idx.extra.get("keys", [])
        for key, size in zip(keys, idx.extra.get("sizes") or [0] * len(keys)):
            found.add(key, -1, size, 0)
        return idx, found.build()
    idx = index.load(src, storage_options)
    for shard in idx.shards:
        if shard.offsets is None:
            raise SourceError(f"{storage.join(src, shard.name)}: index lacks sample offsets (run `shardkit index`)")
        for a, b in zip(shard.offsets, shard.offsets[1:]):
            found.add(f"{shard.name}@{a}:{b}", -1, b - a, 0)
    return idx, found.build()
