"""The formats a dataset's samples are stored in, by name (the index's `kind`): the one
place a format's name is looked up. Everything else asks the `Format` what it needs to know.

Each format module works on files or environments it is handed and never imports storage:

- tar.py: WebDataset tar shards: the header layout, the readers' limits, and `iter_samples`
  and `scan`, which read a whole shard. tar_writer.py's `TarWriter` writes a shard
  deterministically (a sample's members adjacent, fixed headers) and records each sample's
  offset; tar_sample.py's `read_sample` reads one sample's byte range.
- lmdb.py: one LMDB, one record per member (key `KEY.EXT`), the index stored inside.
  `Writer` commits a job's samples and its progress in one transaction; `read_one` reads a
  sample by key.

Around them, each side plugs a format in once, in its registry by these names: the packer a
sink (packing/sinks/) and the reader a sample source (reading/sources/). Adding a format
is a module here, an entry in `REGISTRY`, a sink and a source (tests/test_registry.py holds
the line). This package imports nothing of shardkit's but errors, so the index may ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CorruptShardError


@dataclass(frozen=True)
class Format:
    """What the rest of shardkit may ask about a format, instead of its name.

    sharded: the dataset is shard files in its folder, each sample a byte range of one (its
      offsets in the index's offsets file, each file's version pinned); else it is one database
      whose samples are records found by key (the index lists a key and a size for each).
    local_only: written and read on a local file system only (a remote one is copied whole).
    noun: how a report names one dataset of this format ("an LMDB"); `plural` its shards.
    """

    name: str
    sharded: bool
    local_only: bool
    noun: str


REGISTRY: dict[str, Format] = {
    f.name: f
    for f in (
        Format("tar", sharded=True, local_only=False, noun="a folder of tar shards"),
        Format("lmdb", sharded=False, local_only=True, noun="an LMDB"),
    )
}
FORMATS = tuple(REGISTRY)  # the names, the first the default
DEFAULT = FORMATS[0]


def get(name: Any, where: str | None = None) -> Format:
    """The format called `name`. An unknown name (what an index.json or a caller says) fails
    in one line naming `where` it was found and the names known; None for `where`: a name
    shardkit itself checked already."""
    found = REGISTRY.get(name) if type(name) is str else None
    if found is None:
        said = f"{where}: kind" if where is not None else "format"
        raise CorruptShardError(
            f"{said} {name!r}, not a format this shardkit reads ({' or '.join(map(repr, FORMATS))})"
        )
    return found
