"""Sidecars: files beside an image that belong to its sample, as `photo.txt` (a caption),
`photo.json` (boxes, metadata) and `photo.seg.png` (a mask) belong to `photo.jpg`.

A file is a sidecar when its name is an image's name without its extension, a dot and a
sidecar field (DEFAULT_FIELDS and those `fields` names): `photo` + `.seg.png`. It becomes
that field of the image's sample (of each image of that stem: `photo.jpg` and `photo.png`
are two samples, each with the caption). One whose image is missing is left out, and
listed, as any file that is not an image is (with the same reason: a pack of a folder with
notes in it is the pack it was before sidecars).

A sample's sidecars and values (a manifest's columns) travel with its item as one string
(`encode`): field, kind (FILE: a file to read, VALUE: the field's text), text, each
NUL-terminated (NUL is in no file name, and refused in a manifest's values).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ..errors import shown_name
from ..formats.tar import member_size
from ..index import Skipped
from . import images

DEFAULT_FIELDS = ("cls", "json", "seg.png", "txt")
FILE, VALUE = "f", "v"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9][A-Za-z0-9_-]*)*")


class BadField(images.BadImage):
    """A sidecar's bytes cannot be the field it is named for; the message says why."""


class File(NamedTuple):
    path: str  # relative to the source's folder, '/'-separated
    size: int
    marker: int  # its modification time (ns), or a hash of a store's ETag: what tells a changed file


class Sample(NamedTuple):
    image: File
    extras: tuple[tuple[str, File], ...]  # (field, sidecar), by field


def valid_name(field: str) -> bool:
    """Whether `field` can follow a key's dot: `txt`, `depth.png` (no `/`, no `_` first)."""
    return bool(_NAME.fullmatch(field))


def check_fields(fields: Iterable[str]) -> tuple[str, ...]:
    """The sidecar fields, DEFAULT_FIELDS and `fields`, checked; longest first, so that
    `photo.seg.png` is photo's `seg.png` rather than an image of stem `photo.seg`."""
    if isinstance(fields, str):
        raise TypeError(f"fields must be a list of field names, not the str {fields!r}")
    out = set(DEFAULT_FIELDS)
    for field in fields:
        if not isinstance(field, str) or not valid_name(field):
            raise ValueError(
                f"fields: {field!r} is not a field name (letters, digits, '_' and '-', dot-separated, "
                "as in 'txt' or 'depth.png')"
            )
        if "." + field.lower() in images.EXTENSIONS:
            raise ValueError(f"fields: {field!r} is an image extension: such a file is an image of its own")
        out.add(field.lower())
    return tuple(sorted(out, key=lambda f: (-len(f), f)))


def group(files: Sequence[File], fields: Sequence[str], classes: bool) -> tuple[list[Sample], list[Skipped]]:
    """The images among `files` (sorted by path), each with its sidecars, and what is left
    out, with the reason. Under class folders (`classes`) a `.cls` file is left out: the
    folder gives the class."""
    stems: dict[str, list[File]] = {}  # folder/stem -> its images
    for f in files:
        if images.field_for(f.path) is not None:
            stems.setdefault(_stem(f.path), []).append(f)
    owner = {}  # a sidecar's path -> (folder/stem of its images, field)
    for f in files:
        match = _sidecar(f.path, fields)
        if match is not None and (match[0] in stems or images.field_for(f.path) is None):
            owner[f.path] = match
    extras: dict[str, list[tuple[str, File]]] = {}
    skipped = []
    for f in files:
        if f.path not in owner:
            if images.field_for(f.path) is None:
                skipped.append(Skipped(f.path, "not an image file extension"))
            continue
        stem, field = owner[f.path]
        if not any(i.path not in owner for i in stems.get(stem, ())):  # no image: a file like any other
            skipped.append(Skipped(f.path, "not an image file extension"))
        elif field == "cls" and classes:
            skipped.append(
                Skipped(f.path, "a class file beside an image in a class folder: the folder gives its class")
            )
        else:
            extras.setdefault(stem, []).append((field, f))
    samples = [
        Sample(f, tuple(sorted(extras.get(_stem(f.path), ()))))
        for f in files
        if images.field_for(f.path) is not None and f.path not in owner
    ]
    return samples, skipped


def _stem(path: str) -> str:
    return path[: path.rfind(".")]


def _sidecar(path: str, fields: Sequence[str]) -> tuple[str, str] | None:
    """(folder/stem, field) where the file's name is a stem, a dot and a field."""
    lower, name_start = path.lower(), path.rfind("/") + 1
    for field in fields:
        cut = len(path) - len(field) - 1
        if cut > name_start and path[cut] == "." and lower.endswith(field):
            return path[:cut], field
    return None


def encode(extras: Iterable[tuple[str, str, str]]) -> str:
    """(field, kind, text) triples as one string."""
    return "".join(f"{field}\0{kind}\0{text}\0" for field, kind, text in extras)


def decode(text: str) -> list[tuple[str, str, str]]:
    parts = text.split("\0")
    return [(parts[i], parts[i + 1], parts[i + 2]) for i in range(0, len(parts) - 1, 3)]


def of_files(sample: Sample) -> tuple[str, int, tuple[str, ...]]:
    """(extras, their bytes in a tar shard, their fields) of a sample's sidecars."""
    return (
        encode((field, FILE, f.path) for field, f in sample.extras),
        sum(member_size(f.size) for _, f in sample.extras),
        tuple(field for field, _ in sample.extras),
    )


def marker(sample: Sample) -> int:
    """The sample's change marker: its image's, or (with sidecars) a hash of all of theirs."""
    if not sample.extras:
        return sample.image.marker
    parts = [sample.image.marker, *((field, f.size, f.marker) for field, f in sample.extras)]
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:7], "big")


_KINDS = {
    "cls": "an integer class",
    "json": "valid JSON",
    "jsn": "valid JSON",
    "txt": "UTF-8 text",
    "text": "UTF-8 text",
    "transcript": "UTF-8 text",
}


def check(field: str, data: bytes, where: str) -> None:
    """Raise BadField (naming `where`) where a sidecar's bytes cannot be what the readers
    decode its field as: a class that is no integer, JSON that does not parse, a caption
    that is not UTF-8, an image that fails images.check. Other fields are kept as they are."""
    kind = field.lower().rsplit(".", 1)[-1]
    image = images.field_for("." + kind)
    try:
        if kind == "cls":
            int(data)
        elif kind in ("json", "jsn"):
            json.loads(data)
        elif kind in _KINDS:
            data.decode("utf-8")
        elif image is not None:
            images.check(data, image)
    except images.BadImage as e:
        raise BadField(f"{shown_name(where)}: {e}") from None
    except (ValueError, RecursionError) as e:
        raise BadField(f"{shown_name(where)}: not {_KINDS[kind]} ({e})") from None
