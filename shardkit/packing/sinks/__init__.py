"""The packing side's registry: a format's name -> the Sink that writes it (see commit.py's
`Sink`), the one place the packer looks a format's name up."""

from __future__ import annotations

from ...formats import FORMATS
from ..commit import Sink
from .lmdb import LmdbSink
from .tar import TarSink

SINKS: dict[str, type[Sink]] = {sink.name: sink for sink in (TarSink, LmdbSink)}


def sink_for(name: object) -> type[Sink]:
    """The sink of the format `name`; an unknown one fails naming the formats known."""
    found = SINKS.get(name) if type(name) is str else None
    if found is None:
        raise ValueError(f"format must be {' or '.join(map(repr, FORMATS))}, not {name!r}")
    return found
