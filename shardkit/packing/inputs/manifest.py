"""Manifests: `train.csv` (a header row, then a row per sample) or `train.jsonl` (a JSON
object per line) listing images, by paths relative to the manifest's folder, with what else
each sample holds.

Columns (CSV) or keys (JSONL):
- `path` or `file_name` (Hugging Face's imagefolder name): the image. Required.
- `label` or `cls`: the class, field `cls`. Names become class numbers by sorted name, as
  class folders do; where every label is a number (an integer, or digits), it is the class.
- `caption`, `text` or `txt`: the caption, field `txt` (read back as a str).
- any other: a field of that name; a JSONL value that is not a string is stored as JSON
  (a `json` column, boxes or metadata, reads back as its value).
A missing value (an empty cell, null, an absent key) gives no field. A row that cannot be
used (no path, a path outside the folder, a missing label, not JSON) is left out and listed
as `train.csv:LINE`; an image that does not exist is left out and listed by its path.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

from ... import storage
from ...errors import SourceError, about_the_file
from ...formats.tar import member_size
from ...index import Skipped
from ...storage import StorageOptions
from .. import images, sidecars
from ..listing import Listing, ListingBuilder, change_marker
from .kind import Kind, Scanned

SUFFIXES = (".csv", ".jsonl")
IMAGE_KEYS = ("path", "file_name")
LABEL_KEYS = ("label", "cls")
CAPTION_KEYS = ("caption", "text", "txt")

Row = tuple[int, str, Any, list[tuple[str, str]]]  # line, image path, label (None: none), (field, text)s


def claims(src: str, storage_options: StorageOptions | None = None) -> str | None:
    """A `.csv` or `.jsonl` file is a manifest, by its name alone."""
    return "manifest" if src.lower().endswith(SUFFIXES) else None


def scan(src: str, storage_options: StorageOptions | None, layout: str, fields: tuple[str, ...]) -> Scanned:
    """The manifest's items, read from its folder (`layout` and `fields` are an image folder's)."""
    classes, listing, skipped = scan_manifest(src, storage_options)
    return Scanned(root(src), classes, listing, tuple(skipped))


def root(src: str) -> str:
    """The folder a manifest's paths are relative to."""
    folder = src.rstrip("/").rpartition("/")[0]
    return folder or "."


def scan_manifest(
    src: str, storage_options: StorageOptions | None = None
) -> tuple[tuple[str, ...], Listing, list[Skipped]]:
    """Classes (sorted label names; none where the labels are numbers), the images the
    manifest lists with their values, and what was left out."""
    where = storage.display(src)
    try:
        text = storage.read_bytes(src, storage_options).decode("utf-8-sig")
    except FileNotFoundError:
        raise SourceError(f"{where}: no such file") from None
    except UnicodeDecodeError as e:
        raise SourceError(f"{where}: not UTF-8 text ({e})") from None
    name = src.rstrip("/").rpartition("/")[2]
    rows: list[Row] = []
    left_out = []  # (line, what)
    for line, row in _rows(src, text):
        got = row if isinstance(row, str) else _sample(row)
        if isinstance(got, str):
            left_out.append((line, Skipped(f"{name}:{line}", got)))
        else:
            rows.append((line, *got))
    classes, number = _classes([label for _, _, label, _ in rows if label is not None])
    found = ListingBuilder()
    files = _Files(root(src), storage_options)
    for line, path, label, values in rows:
        info = files.stat(path)
        if isinstance(info, str):
            left_out.append((line, Skipped(path, f"{info} ({name} line {line})")))
            continue
        extras = sidecars.encode((field, sidecars.VALUE, value) for field, value in values)
        size = sum(member_size(len(value.encode())) for _, value in values)
        found.add(path, -1 if label is None else number(label), *info, extras, size, tuple(f for f, _ in values))
    listing, skipped = found.build(), [s for _, s in sorted(left_out, key=lambda x: x[0])]
    if not len(listing):
        first = f" (first: {skipped[0].path}: {skipped[0].reason})" if skipped else ""
        raise SourceError(f"{where}: no usable rows, {len(skipped)} left out{first}")
    return classes, listing, skipped


def _rows(src: str, text: str) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """(line, the row as a dict) or (line, why it is no row), in order."""
    if src.lower().endswith(".jsonl"):
        for line, raw in enumerate(text.splitlines(), 1):
            if raw.strip():
                yield line, _json_row(raw)
        return
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header:
        raise SourceError(f"{storage.display(src)}: empty (a header row first: path, label, caption, ...)")
    _check_header(src, header)
    for row in reader:
        if not row:
            continue
        if len(row) != len(header):
            yield reader.line_num, f"{len(row)} values for {len(header)} columns"
        else:
            yield reader.line_num, {k: (v if v != "" else None) for k, v in zip(header, row)}


def _json_row(raw: str) -> dict[str, Any] | str:
    try:
        row = json.loads(raw)
    except ValueError as e:
        return f"not valid JSON ({e})"
    return row if isinstance(row, dict) else "not a JSON object"


def _field(key: str) -> str:
    return "cls" if key in LABEL_KEYS else "txt" if key in CAPTION_KEYS else key


def _check_header(src: str, header: list[str]) -> None:
    where = storage.display(src)
    if not any(k in header for k in IMAGE_KEYS):
        raise SourceError(
            f"{where}: no column for the image path (path or file_name); its columns: {', '.join(header)}"
        )
    seen: dict[str, str] = {}
    for key in header:
        if key in IMAGE_KEYS:
            continue
        field = _field(key)
        if field in seen:
            raise SourceError(f"{where}: columns {seen[field]!r} and {key!r} both give field {field!r}")
        if not sidecars.valid_name(field):
            raise SourceError(
                f"{where}: column {key!r} cannot name a field (letters, digits, '_' and '-', dot-separated)"
            )
        seen[field] = key


def _sample(row: dict[str, Any]) -> tuple[str, Any, list[tuple[str, str]]] | str:
    """(image path, label or None, [(field, text)]) of a row, or why it cannot be used."""
    path = next((row[k] for k in IMAGE_KEYS if row.get(k) is not None), None)
    if not isinstance(path, str) or not path:
        return "no path"
    parts = path.split("/")
    if path.startswith("/") or ".." in parts or "\\" in path or ":" in parts[0]:
        return f"path {path!r} is not inside the manifest's folder"
    if images.field_for(path) is None:
        return f"path {path!r} is not an image file (by its extension)"
    label, values, seen = None, [], set()
    for key, value in row.items():
        field = _field(key)
        if key in IMAGE_KEYS:
            continue
        if field in seen or not sidecars.valid_name(field):
            return f"key {key!r} gives a field twice, or cannot name one"
        seen.add(field)
        if field == "cls":
            label = value
        elif value is not None:
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            if "\0" in text:
                return f"a NUL character in {key!r}"
            try:
                sidecars.check(field, text.encode(), f"column {key!r}")  # what the readers will decode it as
            except sidecars.BadField as e:
                return str(e)
            values.append((field, text))
    if "cls" in seen and label is None:
        return "no label"
    if label is not None and not (isinstance(label, str) or (type(label) is int and label >= 0)):
        return f"label {label!r} is neither a class name nor a class number (an integer >= 0)"
    return path, label, sorted(values)


def _classes(labels: list[Any]) -> tuple[tuple[str, ...], Any]:
    """(class names, label -> class number): numbers as they are, where every label is
    one; else names, numbered in sorted order."""
    if all(type(x) is int or x.isascii() and x.isdigit() for x in labels):
        return (), int
    names = tuple(sorted({str(x) for x in labels}))
    number = {name: i for i, name in enumerate(names)}
    return names, lambda label: number[str(label)]


class _Files:
    """(size, change marker) of the files under a folder, or why there is none."""

    def __init__(self, folder: str, storage_options: StorageOptions | None):
        self._folder, self._listed = folder, None
        if not storage.is_local(folder):  # one listing of the folder rather than a request a row
            prefix = storage.filesystem(folder, storage_options)[1].rstrip("/") + "/"
            self._listed = {
                path[len(prefix) :]: (int(info.get("size") or 0), change_marker(info))
                for path, info in storage.find(folder, storage_options).items()
            }

    def stat(self, path: str) -> tuple[int, int] | str:
        if self._listed is not None:
            return self._listed.get(path, "no such file")
        try:
            st = os.stat(os.path.join(storage.local_path(self._folder), path))
        except OSError as e:
            if not about_the_file(e):
                raise
            return (
                "no such file"
                if isinstance(e, (FileNotFoundError, NotADirectoryError))
                else f"cannot stat ({e.strerror})"
            )
        return (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else "not a file"


KIND = Kind(claims, scan)
