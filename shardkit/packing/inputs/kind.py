"""What every input kind gives the plan: how it is told apart and scanned (`Kind`), and what
a scan found (`Scanned`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...index import Index, Skipped
from ...storage import StorageOptions
from ..listing import Listing

IMAGES = "folder"  # a plan's `input_kind` for images to pack (a folder's or a manifest's), else a format's name


@dataclass(frozen=True)
class Scanned:
    """What a pack reads: the classes, the items in a deterministic order and what was left
    out; `src` where the items are read from (a manifest's folder, a local copy of a dataset
    read from one); `converted` the index of a dataset copied byte for byte (None: images)."""

    src: str
    classes: tuple[str, ...]
    listing: Listing
    skipped: tuple[Skipped, ...] = ()
    converted: Index | None = None

    @property
    def input_kind(self) -> str:
        """The plan's `input_kind`: IMAGES, or the format of the dataset converted."""
        return IMAGES if self.converted is None else self.converted.kind


@dataclass(frozen=True)
class Kind:
    """One kind of input. `claims(src, storage_options)` names SRC as errors show it ("manifest",
    a format's name, "folder"), or None where SRC is not of this kind; `scan(src,
    storage_options, layout, fields)` reads it. `shaped`: `layout` and `fields` apply (an image
    folder); `converts`: the samples are copied byte for byte, keeping their order and keys
    (so resize and quality do not apply)."""

    claims: Callable[[str, StorageOptions | None], str | None]
    scan: Callable[[str, StorageOptions | None, str, tuple[str, ...]], Scanned]
    shaped: bool = False
    converts: bool = False
