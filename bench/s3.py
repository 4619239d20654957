"""What the object-store benchmarks share (remote, remote_peers_run, upload, global_batches,
gcs, profile_remote): a server on loopback with the bucket made, the latency proxy in front
of it, and the storage options that reach it. The servers start as the tests start them
(tests/servers/: one copy of each start-up); their logs go to a folder of the work dir."""

from __future__ import annotations

import atexit
import contextlib
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from tests.servers.fakegcs import fakegcs_binary, serve_fakegcs
from tests.servers.moto import serve_moto
from tests.servers.process import Server, free_port
from tests.servers.proxy import ProxyControl, start_proxy as start_latency_proxy
from tests.servers.seaweed import serve_seaweedfs

__all__ = ["BUCKET", "PREFETCH_ON", "SERVERS", "free_port", "options", "proxy_command", "start_fakegcs"]
__all__ += ["start_moto", "start_proxy", "start_server", "stop"]

BUCKET = "bench"
KEY = SECRET = "bench"
PREFETCH_ON = 16
SERVERS = ("moto", "seaweedfs")
_RUNNING = contextlib.ExitStack()  # every server started here: stopped at exit, if not before
atexit.register(_RUNNING.close)


def _logs(root: Path | None) -> Path:
    """root/server-logs (made), or without a root a temporary folder removed at exit."""
    if root is None:
        return Path(_RUNNING.enter_context(tempfile.TemporaryDirectory(prefix="bench-servers-")))
    folder = root / "server-logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def start_moto(root: Path | None = None) -> tuple[Server, str]:
    """moto_server on a free loopback port, no bucket made: (its process, its endpoint URL)."""
    return _RUNNING.enter_context(serve_moto(_logs(root)))


def start_server(kind: str, root: Path) -> tuple[Server, str]:
    """A local S3 server of `kind` ("moto", or "seaweedfs": a store people run, its master,
    volume server, filer and S3 gateway in one `weed mini` process) on free loopback ports,
    with the bucket made; (its process, its endpoint URL). Credentials: `options`'."""
    if kind == "moto":
        server, url = start_moto(root)
        make_bucket(url)
        return server, url
    folder = root / "seaweedfs"
    shutil.rmtree(folder, ignore_errors=True)
    log = _logs(root) / "seaweedfs.log"
    return _RUNNING.enter_context(serve_seaweedfs(folder, log, key=KEY, secret=SECRET, bucket=BUCKET))


def start_fakegcs(root: Path | None = None) -> tuple[Server, str]:
    """fake-gcs-server in memory on a free loopback port: (its process, its endpoint URL)."""
    exe = fakegcs_binary()
    if exe is None:
        raise SystemExit("fake-gcs-server has no binary for this platform in its wheel")
    return _RUNNING.enter_context(serve_fakegcs(exe, _logs(root) / "fake-gcs-server.log"))


def make_bucket(endpoint: str) -> None:
    """PUT the bucket, signed with `options`' credentials (botocore's signer; urllib)."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    url = f"{endpoint}/{BUCKET}"
    request = AWSRequest(method="PUT", url=url, data=b"")
    S3SigV4Auth(Credentials(KEY, SECRET), "s3", "us-east-1").add_auth(request)
    put = urllib.request.Request(url, method="PUT", headers=dict(request.headers.items()))
    with urllib.request.urlopen(put, timeout=10) as answer:
        answer.read()


def stop(server: Server) -> None:
    server.stop()


def bucket_fs(endpoint: str) -> Any:
    """The bucket through shardkit's own s3fs client (the settings it gives an endpoint of its own)."""
    from shardkit.storage.clients import filesystem

    return filesystem(f"s3://{BUCKET}", options(endpoint))[0]


def start_proxy(upstream: str, latency_ms: float = 0, **settings: float) -> tuple[Server, str, int]:
    """tests/servers/latency_proxy.py in front of `upstream`, with `settings` (its SETTINGS:
    conn_mbps, tail_prob, tail_ms, reset_prob, ...) and seed 1; (process, its URL, its control port).
    Its log goes to a temporary folder, removed at exit."""
    log = _logs(None) / "latency_proxy.log"
    server, url, control = start_latency_proxy(upstream, log, latency_ms, **{**settings, "seed": 1})
    _RUNNING.callback(server.stop)
    return server, url, control.port


def proxy_command(control: int, line: str) -> str:
    """One line to a proxy's control port; its answer line."""
    return ProxyControl(control).send(line) + "\n"


def options(endpoint: str) -> dict:
    return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint}}
