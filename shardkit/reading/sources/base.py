"""What every sample source is to the worker's stream (SampleSource), the read-ahead
options its reads follow (Settings), and what sources share."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

import numpy as np

from ... import storage
from ...formats.gzip import is_gzip_field
from ...index import Index
from ..prefetch import Prefetcher
from ..spec import ReadAhead

Read = tuple[int, int, Any]  # (shard, start, the sample's bytes or the error of its range)


class Settings(Protocol):
    """What a source's reads follow (a ReadSpec's): the read-ahead, and whether the samples
    are pieces of global batches."""

    @property
    def read_ahead(self) -> ReadAhead: ...

    @property
    def global_batches(self) -> bool: ...


class SampleSource(Protocol):
    def reads(
        self,
        ids: np.ndarray,
        reader: storage.RangeReader,
        opts: Settings,
        window: int,
    ) -> tuple[Generator[Read, None, None], Prefetcher[Any, Any] | None]:
        """Each sample of `ids` in order, read ahead; the prefetcher, for the statistics."""

    def parse(self, data: Any, url: str, start: int) -> tuple[dict[str, Any], int]:
        """The sample dict and its size in bytes."""

    def position(self, start: int) -> str:
        """Where a sample sits, for messages."""

    def one(self, i: int, reader: storage.RangeReader) -> dict[str, Any]:
        """Sample `i`, read on its own."""


def gz_fields(idx: Index) -> bool:
    """Whether samples may hold `.gz` fields to inflate: the index lists one, or no fields."""
    return not idx.fields or any(map(is_gzip_field, idx.fields))
