"""An LMDB dataset's records: one per tar-style member (key `KEY.EXT`, value the raw bytes),
the index document under `__index__` and a pack's progress under `__progress__`; a
sample's records found by a cursor walk (its keys are adjacent in LMDB's sorted order) and
read in a transaction."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import CorruptShardError, ShardkitError, UnfinishedPackError

INDEX_KEY = b"__index__"
PROGRESS_KEY = b"__progress__"
DATA_FILE = "data.mdb"  # the lmdb library's name for its data file: a folder holding one is an LMDB
LOCK_FILE = "lock.mdb"
MAX_KEY = 511  # bytes: LMDB's limit on a key (as the lmdb package builds it)


def lmdb_module() -> Any:
    try:
        import lmdb
    except ImportError:
        raise ShardkitError("LMDB support is not installed (pip install lmdb)") from None
    return lmdb


def sample_tables(extra: Mapping[str, Any]) -> tuple[Any, Any]:
    """An LMDB index's per-sample tables as numpy arrays (no per-key objects to copy on
    fork): the keys as UTF-8 bytes (`.decode()` gives one back), and the sizes (None where
    the index has none)."""
    import numpy as np

    sizes = extra.get("sizes")
    return (
        np.array([k.encode() for k in extra["keys"]], dtype="S"),
        None if sizes is None else np.array(sizes, dtype=np.int64),
    )


def is_lmdb(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DATA_FILE))


def check_keys(key: str, fields: Mapping[str, bytes]) -> None:
    """Refuse a sample whose records' keys LMDB cannot hold (a long key from another tool's tar)."""
    longest = max(len(f"{key}.{ext}".encode()) for ext in fields)
    if longest > MAX_KEY:
        raise CorruptShardError(f"sample key {key[:60]!r}...: {longest} bytes as an LMDB key, over LMDB's {MAX_KEY}")


def read_index(env: Any, path: str) -> bytes:
    lmdb = lmdb_module()
    try:
        with env.begin() as txn:
            raw = txn.get(INDEX_KEY)
    except lmdb.MapResizedError:
        raise grown(path) from None
    except lmdb.Error as e:
        raise CorruptShardError(f"{path}: unreadable LMDB ({e})") from None
    if raw is None:
        with env.begin() as txn:
            unfinished = (
                txn.get(PROGRESS_KEY) is not None or not env.stat()["entries"]
            )  # none: killed before its first commit
        if unfinished:
            raise UnfinishedPackError(
                f"{path}: a pack into this LMDB has not finished (rerun the same `shardkit pack` to finish it)"
            )
        raise CorruptShardError(f"{path}: no {INDEX_KEY.decode()} record: an LMDB that `shardkit pack` did not write")
    return bytes(raw)


def members(cur: Any, prefix: bytes) -> Iterator[bytes]:
    """The keys `KEY.EXT` of one sample (`prefix` is `KEY.`), the cursor on each in turn.
    Records of a folder named like the key plus a dot (`v1.2/x` beside `v1`) are another
    sample's: jumped over."""
    more = cur.set_range(prefix)
    while more:
        k = bytes(cur.key())  # a memoryview in a buffers=True transaction
        if not k.startswith(prefix):
            return
        slash = k.find(b"/", len(prefix))
        if slash >= 0:
            more = cur.set_range(k[:slash] + b"0")  # past that folder ("0" follows "/")
            continue
        yield k
        more = cur.next()


def read_sample(txn: Any, key: str, path: str, size: int | None = None) -> dict[str, bytes]:
    """All members `KEY.EXT` of one sample; with `size` (the index's), checked to add up to
    it (a record grown or shrunk in place is refused, not read as the sample)."""
    prefix = f"{key}.".encode()
    fields: dict[str, bytes] = {}
    total = 0
    try:
        with txn.cursor() as cur:
            for k in members(cur, prefix):
                v = cur.value()
                total += len(v)
                if size is not None and total > size:
                    break
                fields[k[len(prefix) :].decode()] = bytes(v)
    except lmdb_module().Error as e:
        raise CorruptShardError(f"{path}: sample {key}: unreadable LMDB ({e})") from None
    if not fields:
        raise CorruptShardError(f"{path}: sample {key} is missing")
    if size is not None and total != size:
        found = f"more than {total} bytes" if total > size else f"{total} bytes in {', '.join(sorted(fields))}"
        raise CorruptShardError(
            f"{path}: sample {key}: {found}, the index says {size} (a member "
            f"{'grown or added' if total > size else 'missing or shrunk'})"
        )
    return fields


def read_one(env: Any, key: str, path: str, size: int | None = None) -> dict[str, bytes]:
    """All members of sample `key`, in a read transaction of its own (one per thread)."""
    try:
        txn = env.begin(buffers=True)
    except lmdb_module().MapResizedError:
        raise grown(path) from None
    except lmdb_module().Error as e:  # the machine's (the reader table full), not the data's
        raise ShardkitError(f"{path}: cannot start a read ({e})") from None
    with txn:
        return read_sample(txn, key, path, size)


def grown(path: str) -> ShardkitError:
    """A data.mdb written past this process's map (a pack finished in place meanwhile):
    adopting the new map would pull it from under this process's other readers."""
    return ShardkitError(
        f"{path}: data.mdb grew past its map since this process opened it (a pack finished "
        "meanwhile): read it from a new process"
    )
