"""A StreamingDataset's samples by global id, one source per format (the index's `kind`):
what the worker's stream calls to read planned samples ahead, parse one, and name it in an
error. Sources are built in the main process and pickled to the workers: they hold numpy
tables and paths, never open files. This is the registry; each source is a module of its own
(base.py: the protocol they follow)."""

from __future__ import annotations

from ... import formats
from ...formats.gzip import MAX_MEMBER
from ...index import Index
from ...storage import StorageOptions
from .base import SampleSource
from .lmdb import LmdbSamples
from .tar import TarSamples


def source_for(
    idx: Index,
    urls: list[str],
    storage_options: StorageOptions | None,
    cache_dir: str | None,
    cache_limit: int,
    max_member: int = MAX_MEMBER,
) -> SampleSource:
    """The sample source of a dataset, by its format; `max_member` caps what a `.gz` field
    (or a compressed shard's sample) inflates to."""
    return SOURCES[formats.get(idx.kind).name].of(idx, urls, storage_options, cache_dir, cache_limit, max_member)


SOURCES: dict[str, type[TarSamples] | type[LmdbSamples]] = {s.format: s for s in (TarSamples, LmdbSamples)}
"""The reading side's registry: a format's name -> its sample source (the index's kind was
checked against formats.FORMATS when it was read)."""
