"""Packing on a Ray cluster of a head and two worker nodes on loopback gives the same bytes
as the local process pool."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardkit

from test_pack import tree_bytes

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False},
    )
    for _ in range(2):
        c.add_node(num_cpus=1, object_store_memory=80 << 20)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def test_ray_pack_matches_the_local_pool(cluster, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (photos / "circle" / "broken.jpg").write_bytes(b"\xff\xd8\xff garbage")
    local = shardkit.pack(str(photos), str(tmp_path / "local"), max_count=4, workers=2, progress=False)
    remote = shardkit.pack(
        str(photos), str(tmp_path / "ray"), max_count=4, executor="ray", ray_address=cluster.address, progress=False
    )
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")
    assert remote.skipped == local.skipped and [s.path for s in remote.skipped] == ["circle/broken.jpg"]
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 3


def test_ray_lmdb_and_rerun(cluster, photos: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    shardkit.pack(
        str(photos),
        str(tmp_path / "db"),
        format="lmdb",
        max_count=4,
        executor="ray",
        ray_address=cluster.address,
        progress=False,
    )
    assert len(shardkit.LMDBDataset(str(tmp_path / "db"))) == 30
    out = tmp_path / "tar"
    shardkit.pack(str(photos), str(out), max_count=4, executor="ray", ray_address=cluster.address, progress=False)
    clean = tree_bytes(out)
    (out / "index.json").unlink()  # a crash before the commit, one shard not written
    (out / "shard-000001.tar").unlink()
    (out / ".shardkit-progress").mkdir()
    shardkit.pack(str(photos), str(out), max_count=4, executor="ray", ray_address=cluster.address, progress=False)
    assert tree_bytes(out) == clean
