"""An image folder: classes in folders (`SRC/<class>/<image>`), or images anywhere under SRC
(`layout="flat"`), each with its sidecars (see packing/sidecars.py). Nothing here reads
image bytes; the result is a Listing in a deterministic order (by whole path).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from ... import index, storage
from ...errors import SourceError, about_the_file
from ...index import Skipped
from ...storage import StorageOptions
from .. import sidecars
from ..listing import Listing, ListingBuilder, change_marker
from .kind import Kind, Scanned

LAYOUTS = ("classes", "flat")

HIDDEN = "hidden entry ignored"  # listed in the index, but not a failure under on_error="raise"
OUTSIDE_CLASSES = "not inside a class folder"  # a file beside the class folders (the CLI hints at --layout flat)


def _walk(
    top: str, rel: str, above: frozenset[tuple[int, int]], skipped: list[Skipped]
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
        child = f"{rel}/{entry.name}" if rel else entry.name
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


def scan_folder(
    src: str,
    storage_options: StorageOptions | None = None,
    layout: str = "classes",
    fields: Sequence[str] = sidecars.DEFAULT_FIELDS,
) -> tuple[tuple[str, ...], Listing, list[Skipped]]:
    """Classes (sorted folder names; none with layout="flat", where images may be anywhere),
    the image files with their sidecars (`fields` as sidecars.check_fields gives them), and
    what was left out."""
    if not storage.is_local(src):
        return _scan_remote(src, storage_options, layout, fields)
    path = storage.local_path(src)
    if not os.path.exists(path):
        raise SourceError(f"{src}: no such folder")
    if not os.path.isdir(path):
        raise SourceError(f"{src}: not a folder (expected SRC/<class>/<image>)")
    skipped: list[Skipped] = []
    found = ListingBuilder()
    if layout == "flat":
        _add(found, _files(_walk(path, "", frozenset(), skipped)), -1, fields, False, skipped)
        return (), _built(found, src, "an image folder"), skipped
    classes = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if not _usable_name(entry.name, entry.name, skipped):
            continue
        if entry.is_dir():
            classes.append(entry.name)
        else:
            skipped.append(Skipped(entry.name, OUTSIDE_CLASSES))
    if not classes:
        shards = any(s.path.endswith(index.SHARD_SUFFIXES) for s in skipped)
        hint = (
            f"; tar shards from another tool are converted once `shardkit index {src}` has indexed them"
            if shards
            else ""
        )
        raise SourceError(
            f"{src}: no class folders (expected SRC/<class>/<image>; images without classes: --layout flat){hint}"
        )
    top = os.stat(path)
    above = frozenset({(top.st_dev, top.st_ino)})  # a class folder linked to SRC itself is a loop too
    for label, name in enumerate(classes):
        _add(found, _files(_walk(os.path.join(path, name), name, above, skipped)), label, fields, True, skipped)
    return tuple(classes), _built(found, src, _folders(len(classes))), skipped


def _folders(n: int) -> str:
    return f"{n} class folder{'s' * (n != 1)}"


def _files(walk: Iterator[tuple[str, os.stat_result]]) -> list[sidecars.File]:
    """The files of a walk, by whole path, as a bucket lists them: a copy of the tree packs
    in the same order. (The walk runs to its end first: its own skips come before ours.)"""
    return [sidecars.File(rel, st.st_size, st.st_mtime_ns) for rel, st in sorted(walk, key=lambda f: f[0])]


def _add(
    found: ListingBuilder,
    files: Sequence[sidecars.File],
    label: int,
    fields: Sequence[str],
    classes: bool,
    skipped: list[Skipped],
) -> None:
    """The images among `files`, each with its sidecars, as items of class `label`."""
    samples, left_out = sidecars.group(files, fields, classes)
    skipped += left_out
    for sample in samples:
        found.add(sample.image.path, label, sample.image.size, sidecars.marker(sample), *sidecars.of_files(sample))


def _built(found: ListingBuilder, src: str, where: str) -> Listing:
    listing = found.build()
    if not len(listing):
        raise SourceError(f"{storage.display(src)}: no image files in {where}")
    return listing


def _scan_remote(
    src: str, storage_options: StorageOptions | None, layout: str, fields: Sequence[str]
) -> tuple[tuple[str, ...], Listing, list[Skipped]]:
    """The same for a bucket prefix, in one recursive listing. As locally, every folder at the
    top is a class, whether it holds images or not (object stores have no empty folders)."""
    root = storage.filesystem(src, storage_options)[1].rstrip("/")
    entries = storage.find(src, storage_options)
    if not entries:
        raise SourceError(f"{storage.display(src)}: no such folder, or empty")
    flat = layout == "flat"
    skipped: list[Skipped] = []
    files: dict[str, list[sidecars.File]] = {}  # class (flat: "") -> its files, by path
    for path in sorted(entries):
        rel = path[len(root) :].lstrip("/")
        top, sep, _ = rel.partition("/")
        if sep and not top.startswith(".") and not flat:
            files.setdefault(top, [])
        if any(part.startswith(".") for part in rel.split("/")):
            skipped.append(Skipped(rel, HIDDEN))
        elif not sep and not flat:
            skipped.append(Skipped(rel, OUTSIDE_CLASSES))
        else:
            info = entries[path]
            files.setdefault("" if flat else top, []).append(
                sidecars.File(rel, int(info.get("size") or 0), change_marker(info))
            )
    classes = () if flat else tuple(sorted(files))
    if not classes and not flat:
        raise SourceError(
            f"{storage.display(src)}: no class folders (expected SRC/<class>/<image>; images without "
            "classes: --layout flat)"
        )
    found = ListingBuilder()
    for label, name in enumerate(classes or ("",)):  # class by class, as locally ("a-b/x" lists before "a/x")
        _add(found, files.get(name, []), label if classes else -1, fields, not flat, skipped)
    skipped.sort(key=lambda s: s.path)  # in the listing's order, as before sidecars
    return classes, _built(found, src, "an image folder" if flat else _folders(len(classes))), skipped


def claims(src: str, storage_options: StorageOptions | None = None) -> str:
    """Anything no other kind claims is an image folder, but an unfinished pack is none either."""
    index.check_finished(src, storage_options)
    return "folder"


def scan(src: str, storage_options: StorageOptions | None, layout: str, fields: tuple[str, ...]) -> Scanned:
    classes, listing, skipped = scan_folder(src, storage_options, layout, fields)
    return Scanned(src, classes, listing, tuple(skipped))


KIND = Kind(claims, scan, shaped=True)
