"""pytest plugin: real storage servers on loopback, for tests that talk to S3, GCS or WebHDFS.

Load it with ``pytest_plugins = ["servers.fixtures"]`` (tests/conftest.py does, with
``servers.store_fixtures`` and ``servers.azurite``).  Each server is one subprocess
per session, started on first use on a free 127.0.0.1 port and stopped at the end (terminate,
5 s, kill); the function-scoped fixtures wipe its state and hand out a fresh bucket or directory::

    def test_x(remote):                      # runs over s3, gcs, webhdfs and azure
        fs, path = fsspec.core.url_to_fs(remote["url"], **remote["storage_options"])

Servers: moto (S3), gcp-storage-emulator (GCS), ``webhdfs_server.py`` (WebHDFS) and
``latency_proxy.py`` (delay, latency tail, per-connection bandwidth cap, RST, stall and
throttling faults in front of any of them), both in this package; ``gcs_conditional`` puts a
gate of GCS's precondition rules (``ifGenerationMatch``, which the emulator ignores) in front
of the emulator. The start-ups, shared with the benchmarks (bench/), are in this package's
modules free of pytest: `process`, `moto`, `proxy`, `seaweed` and `fakegcs`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, NoReturn
from urllib.parse import urlsplit

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read by gcsfs at import

import pytest

from .moto import serve_moto
from . import process
from .gate import Preconditions
from .process import BIN, BUCKET, http, serve_http
from .proxy import ProxyControl, start_proxy
from .threaded import serving

HERE = Path(__file__).resolve().parent


def fail_test(message: str) -> NoReturn:
    """A server's failure, as a test failure that shows the message (its log's tail) alone."""
    pytest.fail(message, pytrace=False)


class Server(process.Server):
    """A server process whose failures fail the test (process.Server's, for the tests)."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        log: Path,
        read_stdout: bool = False,
        on_failure: Callable[[str], NoReturn] = fail_test,
    ) -> None:
        super().__init__(name, cmd, log, read_stdout, on_failure)


@pytest.fixture(scope="session")
def _server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


# -- S3: moto in server mode ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def _moto(_server_logs: Path) -> Iterator[tuple[Server, str]]:
    with serve_moto(_server_logs, on_failure=fail_test) as moto:
        yield moto


@pytest.fixture(scope="session")
def s3_server(_moto: tuple[Server, str]) -> str:
    """The endpoint URL of a moto S3 server (one per session)."""
    return _moto[1]


@pytest.fixture
def s3(_moto: tuple[Server, str]) -> dict:
    """An empty bucket: {"url": "s3://shardkit-test", "storage_options": {...}} for fsspec/s3fs."""
    server, url = _moto
    server.check()
    http("POST", url + "/moto-api/reset")
    http("PUT", f"{url}/{BUCKET}")
    return {
        "url": f"s3://{BUCKET}",
        "storage_options": {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": url},
            "skip_instance_cache": True,  # no stale listings cached from an earlier test
        },
    }


# -- GCS: gcp-storage-emulator -------------------------------------------------------------------
@pytest.fixture(scope="session")
def _gcs_emulator(_server_logs: Path) -> Iterator[tuple[Server, str]]:
    exe = str(BIN / "gcp-storage-emulator")
    cmd = lambda port: [exe, "start", "-H", "127.0.0.1", "--port", str(port), "--in-memory", "-q"]  # noqa: E731
    with serve_http("gcp-storage-emulator", cmd, "/storage/v1/b", _server_logs, on_failure=fail_test) as emulator:
        yield emulator


@pytest.fixture(scope="session")
def gcs_server(_gcs_emulator: tuple[Server, str]) -> str:
    """The endpoint URL of a GCS emulator (one per session; serves one request at a time)."""
    return _gcs_emulator[1]


@pytest.fixture
def gcs(_gcs_emulator: tuple[Server, str]) -> dict:
    """An empty bucket: {"url": "gs://shardkit-test", "storage_options": {...}} for fsspec/gcsfs."""
    server, url = _gcs_emulator
    server.check()
    http("GET", url + "/wipe")
    body = json.dumps({"name": BUCKET}).encode()
    http("POST", url + "/storage/v1/b?project=test", body, {"Content-Type": "application/json"})
    options = {"token": "anon", "project": "test", "endpoint_url": url, "skip_instance_cache": True}
    return {"url": f"gs://{BUCKET}", "storage_options": options}


@pytest.fixture
def gcs_conditional(gcs: dict, gcs_server: str) -> Iterator[dict]:
    """`gcs` as seen through `_Preconditions`: a bucket where uploads and deletes with
    ifGenerationMatch hold to GCS's rules (the emulator alone ignores them)."""
    u = urlsplit(gcs_server)
    gate = type("Gate", (Preconditions,), {"upstream": (u.hostname, u.port)})
    with serving(gate) as base:
        yield {"url": gcs["url"], "storage_options": {**gcs["storage_options"], "endpoint_url": base}}


# -- WebHDFS: webhdfs_server.py (beside this module) over a local directory ----------------------
class WebHDFSServer(NamedTuple):
    namenode: str  # http://127.0.0.1:NN: clients talk here, and are redirected (307) to...
    datanode: str  # http://127.0.0.1:DN: ...here, for the bytes of CREATE, APPEND and OPEN
    root: Path  # the local directory that holds the tree
    server: Server


@pytest.fixture(scope="session")
def webhdfs_server(_server_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebHDFSServer]:
    """A WebHDFS namenode + datanode (one per session) over a local directory."""
    root = tmp_path_factory.mktemp("webhdfs-root")
    cmd = [sys.executable, str(HERE / "webhdfs_server.py"), str(root), "--port", "0", "--data-port", "0"]
    server = Server("webhdfs_server", cmd, _server_logs / "webhdfs_server.log", read_stdout=True, on_failure=fail_test)
    try:
        nn, dn = server.wait_line()
        yield WebHDFSServer(f"http://127.0.0.1:{nn}", f"http://127.0.0.1:{dn}", root, server)
    finally:
        server.stop()


@pytest.fixture
def webhdfs(webhdfs_server: WebHDFSServer) -> dict:
    """An empty /data directory: {"url": "webhdfs://127.0.0.1:NN/data", "storage_options": {...}}."""
    webhdfs_server.server.check()
    for child in webhdfs_server.root.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    (webhdfs_server.root / "data").mkdir()
    port = urlsplit(webhdfs_server.namenode).port
    return {
        "url": f"webhdfs://127.0.0.1:{port}/data",
        "storage_options": {"user": "shardkit", "skip_instance_cache": True},
    }


# -- all of them ---------------------------------------------------------------------------------
@pytest.fixture(params=["s3", "gcs", "webhdfs", "seaweedfs", "fakegcs", "azure"])  # store_fixtures.py, azurite.py
def remote(request: pytest.FixtureRequest) -> dict:
    """Each of s3, gcs, webhdfs, SeaweedFS's S3, fake-gcs-server and azure (Azurite) in turn:
    {"url": ..., "storage_options": {...}}."""
    return request.getfixturevalue(request.param)


# -- faults: latency_proxy.py (proxy.py starts it) -------------------------------------------
@pytest.fixture(scope="session")
def latency_proxy(_server_logs: Path) -> Iterator[Callable[..., tuple[str, ProxyControl]]]:
    """A factory: start(upstream_url, latency_ms=0, conn_mbps=, tail_prob=, tail_ms=, reset_prob=, ..., seed=)
    -> (the same URL through a new proxy, its ProxyControl).  Every proxy stops at session end."""
    started: list[Server] = []

    def start(upstream_url: str, latency_ms: float = 0, **opts: float) -> tuple[str, ProxyControl]:
        log = _server_logs / f"latency_proxy{len(started)}.log"
        server, url, control = start_proxy(upstream_url, log, latency_ms, on_failure=fail_test, **opts)
        started.append(server)
        return url, control

    try:
        yield start
    finally:
        for server in started:
            server.stop()


# -- HTTP servers of our own, in a thread (threaded.py) ------------------------------------------
@pytest.fixture
def forbidding() -> Iterator[tuple[str, list[str]]]:
    """(endpoint URL, request log) of an HTTP server on loopback that answers every request
    403 Forbidden, as S3 (XML) or GCS (JSON) does for credentials without access."""

    log: list[str] = []

    class Refuse(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            log.append(f"{self.command} {self.path}")
            if self.path.startswith(("/storage/", "/download/", "/upload/")):  # the GCS JSON API
                body, kind = json.dumps({"error": {"code": 403, "message": "denied"}}).encode(), "application/json"
            else:
                body, kind = (
                    b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>",
                    "application/xml",
                )
            self.send_response(403)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _refuse

        def log_message(self, *args: object) -> None:
            pass

    with serving(Refuse) as base:
        yield base, log
