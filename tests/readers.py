"""Helpers for the tests that read datasets: keys of a pass, a pass that must fail, a
pack, a sample's bytes located and broken in place, the rank-split check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit.reading.dataset import StreamingDataset

from conftest import shard_offsets
from resume import sample_keys

WARNINGS = [
    # 3 workers on a 2-core runner is deliberate: torch warns, and warnings are errors here
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    # torchdata's StatefulDataLoader calls an API torch deprecated
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]

ALL_KEYS = [f"{i:06d}" for i in range(120)]  # the `packed` fixture's keys
SIZE = (48, 40)  # conftest.draw's default image size (W, H)


def keys_of(loader: Any) -> list[str]:
    """Sample keys in the order a loader (or a dataset) yields them, batched or not."""
    return [k for item in loader for k in sample_keys(item)]


def loader_of(
    dataset: Path,
    options: dict[str, Any] | None = None,
    *,
    epoch: int | None = None,
    stateful: bool = False,
    **loader: Any,
) -> Callable[[], Any]:
    """A function that makes a fresh (Stateful)DataLoader over a fresh shuffled dataset (seed 5
    unless `options` say otherwise), set to `epoch` if one is given: a build for check_save_load."""

    def build() -> Any:
        ds = StreamingDataset(str(dataset), **{"shuffle": True, "seed": 5, **(options or {})})
        if epoch is not None:
            ds.set_epoch(epoch)
        if stateful:
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(ds, **loader)
        return DataLoader(ds, **loader)

    return build


def run(ds: StreamingDataset, num_workers: int = 0, batch_size: int | None = None, **kw: Any) -> list[str]:
    return keys_of(DataLoader(ds, num_workers=num_workers, batch_size=batch_size, **kw))


def failure(ds: StreamingDataset, num_workers: int) -> BaseException:
    """The error a pass raises. The loader is dropped at once, without a traceback keeping it
    alive: collected later by the cycle collector, its workers take 5 s each to shut down."""
    it = iter(DataLoader(ds, num_workers=num_workers, batch_size=None))
    try:
        for _ in it:
            pass
    except Exception as e:  # noqa: BLE001
        err = e.with_traceback(None)
        err.__context__ = err.__cause__ = None
    else:
        raise AssertionError("the pass did not fail")
    del it
    return err


def take(loader: Any, batches: int) -> list[str]:
    it = iter(loader)
    return [k for _ in range(batches) for k in next(it)["__key__"]]


def pack(src: Path, dest: Path, **kw: Any) -> Path:
    shardkit.pack(str(src), str(dest), workers=1, progress=False, **kw)
    return dest


def sample_span(dataset: Path, shard: int, sample: int, ext: str) -> tuple[Path, int, int, str]:
    """(shard file, byte offset, size, key) of one member of one sample, from index.json."""
    name = json.loads((dataset / "index.json").read_text())["shards"][shard]["name"]
    path = dataset / name
    data = path.read_bytes()
    pos, end = shard_offsets(dataset)[name][sample : sample + 2]
    while pos < end:
        name = data[pos : pos + 100].split(b"\0")[0].decode()
        size = int(data[pos + 124 : pos + 135], 8)
        if name.endswith("." + ext):
            return path, pos + 512, size, name.split(".")[0]
        pos += 512 + size + (-size % 512)
    raise AssertionError(f"no .{ext} member in sample {sample} of {path}")


def break_image(dataset: Path, shard: int, sample: int) -> tuple[str, str]:
    """Overwrite one sample's JPEG bytes in place (same size): (shard name, key)."""
    path, pos, size, key = sample_span(dataset, shard, sample, "jpg")
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(b"not a jpeg " * (size // 11) + b"!" * (size % 11))
    return path.name, key


def check_ranks(per_rank: list[list[str]], everything: list[str], remainder: str, expected_len: int) -> None:
    world = len(per_rank)
    for keys in per_rank:
        assert len(keys) == expected_len
        assert len(set(keys)) == len(keys), "a rank yielded a sample twice"
    union = set().union(*map(set, per_rank))
    assert union <= set(everything)
    if remainder == "repeat":
        assert union == set(everything)
    else:
        assert len(everything) - len(union) < world
        assert sum(map(len, per_rank)) == len(union)
