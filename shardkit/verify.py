"""Re-read every shard of a dataset and check it against its index."""

from __future__ import annotations

from collections.abc import Callable

from . import index, storage
from .errors import ShardkitError
from .index import ShardInfo
from .sources import scan_shard
from .storage import StorageOptions


def verify(url: str, storage_options: StorageOptions | None = None,
           on_shard: Callable[[ShardInfo, str | None], None] | None = None) -> list[str]:
    """Re-read every shard of the dataset at `url`; return one line per problem (empty: all good).

    Checks each shard's size, sha256, sample count and sample offsets against index.json.
    `on_shard(info, problem)` is called after each shard (for progress output).
    """
    idx = index.load(url, storage_options)
    problems = []
    for info in idx.shards:
        shard_url = storage.join(url, info.name)
        problem = None
        try:
            found = scan_shard(shard_url, storage_options).info
        except FileNotFoundError:
            problem = f"{shard_url}: missing"
        except ShardkitError as e:
            problem = str(e)
        else:
            if found.bytes != info.bytes:
                problem = f"{shard_url}: {found.bytes} bytes, index says {info.bytes}"
            elif info.sha256 is not None and found.sha256 != info.sha256:
                problem = f"{shard_url}: sha256 mismatch (shard changed or corrupt)"
            elif found.samples != info.samples:
                problem = f"{shard_url}: {found.samples} samples, index says {info.samples}"
            elif info.offsets is not None and found.offsets != info.offsets:
                problem = f"{shard_url}: sample offsets differ from the index"
        if problem:
            problems.append(problem)
        if on_shard:
            on_shard(info, problem)
    return problems
