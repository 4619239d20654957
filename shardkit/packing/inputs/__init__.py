"""What a pack reads, by kind, one module each: a manifest (manifest.py: a `.csv` or `.jsonl`
list of images), a shardkit dataset to convert (dataset.py), or an image folder (folder.py:
anything else). `INPUTS` is the registry, asked in order: the first kind that claims SRC
reads it. Adding an input kind is a module here and an entry in INPUTS."""

from __future__ import annotations

from ... import storage
from ...errors import SourceError
from ...storage import StorageOptions
from . import dataset, folder, manifest
from .kind import IMAGES, Kind, Scanned

INPUTS: dict[str, Kind] = {"manifest": manifest.KIND, "dataset": dataset.KIND, "folder": folder.KIND}

__all__ = ["IMAGES", "INPUTS", "Kind", "Scanned", "identify"]


def identify(src: str, storage_options: StorageOptions | None = None) -> tuple[Kind, str]:
    """The kind of input SRC is, and its name as errors show it ("manifest", "folder", or the
    format of a dataset to convert)."""
    for kind in INPUTS.values():
        if (named := kind.claims(src, storage_options)) is not None:
            return kind, named
    raise SourceError(f"{storage.display(src)}: no input kind reads it")  # not so while folder claims all
