"""Re-read every shard of a dataset (or every record of an LMDB) and check it against its index."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from .. import checks, formats, index, storage
from ..decode import packed_from
from ..packing import images
from ..errors import ShardkitError
from ..formats import lmdb as lmdb_format
from ..index import Index, ShardInfo
from ..index.resolve import local_lmdb, shard_digest, shard_problem
from ..storage import StorageOptions


def verify(
    url: str,
    storage_options: StorageOptions | None = None,
    on_shard: Callable[[ShardInfo, str | None], None] | None = None,
) -> list[str]:
    """Re-read every shard of the dataset at `url`; return one line per problem (empty: all good).

    Checks each shard's size, sha256, sample count and sample offsets against index.json,
    and that no .tar file beside them is missing from it; for an LMDB, see `_verify_lmdb`.
    `on_shard(info, problem)` is called after each shard (for progress output).

    Args:
        url: the dataset's folder or URL prefix.
        storage_options: passed to fsspec unchanged.
        on_shard: called with each shard's index entry and its problem (None: good).
    """
    url = checks.path("url", url)
    idx = index.load(url, storage_options)
    if not formats.get(idx.kind).sharded:
        problem = _verify_lmdb(url, idx, storage_options)
        if on_shard:
            on_shard(idx.shards[0], problem)
        return [problem] if problem else []
    problems = _offsets_file_problem(idx, storage_options)
    try:
        idx = index.with_offsets(idx, storage_options)
    except ShardkitError as e:  # the offsets cannot be read: the shards' bytes can still be checked
        problems.append(str(e))
    else:
        problems += _offsets_lacking(url, idx)
    for info in idx.shards:
        shard_url = storage.join(url, info.name)
        where = storage.display(shard_url)
        try:
            problem = shard_problem(shard_url, info, storage_options)
            problem = problem and f"{where}: {problem}"
        except FileNotFoundError:
            problem = f"{where}: missing"
        except ShardkitError as e:
            problem = str(e)
        except OSError as e:  # a folder in its place, unreadable: say so and go on to the next shard
            problem = f"{where}: {e.strerror or e}"
        if problem:
            problems.append(problem)
        if on_shard:
            on_shard(info, problem)
    return problems + _unlisted(url, idx, storage_options)


def _offsets_file_problem(idx: Index, storage_options: StorageOptions | None) -> list[str]:
    """The offsets file against the sha256 index.json records for it."""
    if idx.offsets_file is None:
        return []
    url = storage.join(idx.offsets_file.folder, idx.offsets_file.file)
    try:
        _, sha = shard_digest(url, storage_options)
    except FileNotFoundError:
        return [f"{storage.display(url)}: missing (index.json names it for its sample offsets)"]
    if sha != idx.offsets_file.sha256:
        return [f"{storage.display(url)}: sha256 mismatch with the index (sample offsets changed or corrupt)"]
    return []


def _offsets_lacking(url: str, idx: Index) -> list[str]:
    """A tar index whose shards carry no sample offsets (a version 1 index without them):
    the shards may be whole, but both readers refuse the index."""
    lacking = [s.name for s in idx.shards if s.offsets is None]
    if not lacking:
        return []
    return [
        f"{storage.display(storage.join(url, index.INDEX_NAME))}: lists no sample offsets for {len(lacking)} of "
        f"its {len(idx.shards)} shards (first: {lacking[0]}), and readers refuse it: rebuild it with "
        f"`shardkit index {storage.display(url)}`"
    ]


def undecodable(url: str, storage_options: StorageOptions | None = None, workers: int | None = None) -> list[str]:
    """One line per image that does not decode in full (every image field of every sample,
    decoded as `shardkit pack --decode-check` does), read through a DataLoader with
    `workers` processes (default: the CPU count). Needs PyTorch."""
    from torch.utils.data import DataLoader

    from ..reading.dataset import StreamingDataset

    workers = checks.optional("workers", workers, 0)
    # rank 0 of 1 whatever RANK and WORLD_SIZE say: every image once, no share of them
    ds = StreamingDataset(
        checks.path("url", url), storage_options=storage_options, transform=_image_problems, rank=0, world_size=1
    )
    loader = DataLoader(ds, batch_size=None, num_workers=(os.cpu_count() or 1) if workers is None else workers)
    return sorted(problem for problems in loader for problem in problems)


def _image_problems(sample: dict[str, Any]) -> list[str]:
    """What is wrong with the sample's images, a line each (a DataLoader worker's transform)."""
    where = f"{storage.display(sample['__url__'])}: sample {sample['__key__']!r}{packed_from(sample)}"
    return [f"{where}: field {field!r}: {e}" for field, e in images.bad_images(sample)]


def _unlisted(url: str, idx: Index, storage_options: StorageOptions | None) -> list[str]:
    """A .tar beside the shards that the index does not list. Best effort: a store that lets
    shards be read but not listed (a CDN, a bucket without ListBucket) has nothing to say."""
    try:
        names = storage.listdir(url, storage_options)
    except (OSError, ShardkitError):
        return []
    listed = {info.name for info in idx.shards}
    return [
        f"{storage.display(storage.join(url, name))}: a shard the index does not list (readers skip it)"
        for name in names
        if name.endswith(index.SHARD_SUFFIXES) and name not in listed
    ]


def _verify_lmdb(url: str, idx: Index, storage_options: StorageOptions | None) -> str | None:
    """The first problem of an LMDB dataset, if any: data.mdb opens and is complete, the
    index stored inside it is index.json's, every sample of the index is there with the
    byte count the index records, and no record belongs to no sample. (LMDB keeps no
    checksums of values: bytes changed in place are not detected.) Problems name `url`, not
    the local copy of a remote one.

    The records are walked in a child process: on some damage LMDB aborts or faults the
    process reading it, which must not take the caller with it."""
    path = local_lmdb(url, storage_options, None)
    where = storage.display(url)
    # this process's imports (this shardkit first), never the working folder's modules
    paths = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    paths += [p for p in sys.path if isinstance(p, str) and os.path.isabs(p)]
    code = (
        "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from shardkit.tools.verify import _walk_lmdb_child; "
        "_walk_lmdb_child()"
    )
    child = subprocess.run(
        [sys.executable, "-I", "-c", code, json.dumps(paths)],
        capture_output=True,
        text=True,
        input=json.dumps({"path": path, "index": idx.to_json()}),
    )
    said = (child.stderr.strip().splitlines() or [""])[-1]  # LMDB's assertion, a Python error
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name
        return f"{where}: data.mdb is corrupt (reading its records crashed LMDB: {name}{': ' * bool(said)}{said})"
    if child.returncode != 0:
        raise ShardkitError(f"{where}: checking the records failed (exit status {child.returncode}): {said}")
    problem = json.loads(child.stdout)
    return problem.replace(path, where) if problem else None  # open_reader's name the local copy


def _walk_lmdb_child() -> None:
    """_verify_lmdb's child: the problem (or null) as JSON on stdout."""
    job = json.load(sys.stdin)
    path = job["path"]
    idx = Index.from_json(job["index"], path)
    json.dump(_walk_lmdb(path, idx), sys.stdout)


def _walk_lmdb(path: str, idx: Index) -> str | None:
    try:
        env = lmdb_format.open_reader(path)
        if Index.from_json(lmdb_format.read_index(env, path), path).to_json() != idx.to_json():
            return f"{path}: index.json differs from the index stored in data.mdb"
        keys, sizes = idx.extra.get("keys", []), idx.extra.get("sizes")
        records = 1  # the index's own
        with env.begin(buffers=True) as txn:
            for i, key in enumerate(keys):
                records += len(lmdb_format.read_sample(txn, key, path, sizes[i] if sizes is not None else None))
        extra = env.stat()["entries"] - records
        if extra:
            return f"{path}: {extra} stray record(s), part of no sample in the index"
    except ShardkitError as e:
        return str(e)
    return None
