"""The cache root's layout (storage/cache.py): one folder per kind of copy, the default root
for the copies a read cannot do without, what cache_limit bounds, and the earlier layout's
files still found."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from shardkit.storage import cache
from shardkit.storage.cache import BLOCKS, LMDB, OFFSETS, RangeCache, range_cache


def test_each_kind_has_its_folder_under_the_root(tmp_path: Path) -> None:
    root = str(tmp_path / "c")
    assert [cache.folder(kind, root) for kind in (BLOCKS, LMDB, OFFSETS)] == [
        os.path.join(root, "blocks"),
        os.path.join(root, "lmdb"),
        os.path.join(root, "offsets"),
    ]
    assert cache.lmdb_copies(root, "d" * 24) == os.path.join(root, "lmdb", "d" * 24)


def test_without_a_cache_dir_whole_copies_go_to_the_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cache.folder(OFFSETS, None) == str(tmp_path / "shardkit-cache" / "offsets")
    assert cache.lmdb_copies(None, "x") == str(tmp_path / "shardkit-cache" / "lmdb" / "x")
    assert range_cache(None, 1 << 20) is None  # blocks are kept only where a cache_dir is given
    assert not (tmp_path / "shardkit-cache").exists()


def test_blocks_go_in_their_folder_capped_by_the_limit(tmp_path: Path) -> None:
    blocks = range_cache(str(tmp_path), limit=1000)
    assert isinstance(blocks, RangeCache) and blocks.root == str(tmp_path / "blocks")
    for i in range(5):
        blocks.put("s3://b/x.tar", "v1", i * 300, (i + 1) * 300, b"x" * 300)
    kept = list((tmp_path / "blocks").iterdir())
    assert sum(p.stat().st_size for p in kept) <= 1000 and os.listdir(tmp_path) == ["blocks"]
    assert blocks.get("s3://b/x.tar", "v1", 1200, 1500) == b"x" * 300  # the latest is kept


def test_the_earlier_layouts_files_are_still_found(tmp_path: Path) -> None:
    """Blocks at the top of cache_dir and an LMDB's copies in lmdb-<digest>/ (where they
    were before one folder a kind) are moved into place, not fetched again."""
    before = RangeCache(str(tmp_path), limit=10_000)  # the earlier layout: blocks at the root
    before.put("s3://b/x.tar", "v1", 0, 5, b"hello")
    (tmp_path / "notes.blk").write_text("not a block")  # not a block's name: left alone
    old_copy = tmp_path / "lmdb-abc" / "v1"
    old_copy.mkdir(parents=True)
    (old_copy / "data.mdb").write_bytes(b"db")
    now = range_cache(str(tmp_path), limit=10_000)
    assert now is not None and now.get("s3://b/x.tar", "v1", 0, 5) == b"hello"
    assert (tmp_path / "notes.blk").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "blocks",
        "lmdb-abc",
        "notes.blk",
    ]
    assert cache.lmdb_copies(str(tmp_path), "abc") == str(tmp_path / "lmdb" / "abc")
    assert (tmp_path / "lmdb" / "abc" / "v1" / "data.mdb").read_bytes() == b"db"
    assert not (tmp_path / "lmdb-abc").exists()


def test_cache_limit_bounds_each_whole_copy() -> None:
    assert cache.whole_copy_fits(100, 100) and cache.whole_copy_fits(1 << 40, None)
    assert not cache.whole_copy_fits(101, 100)
