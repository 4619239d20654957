"""The loopback storage servers (tests/servers/) work end to end with plain fsspec."""

from __future__ import annotations

import copy
import http.client
import os
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import botocore.exceptions
import fsspec
import pytest

# also loaded by conftest.py or `-p servers.fixtures`; registering twice is a no-op
pytest_plugins = ["servers.fixtures"]

MiB = 1 << 20


def names(listing: list[str]) -> list[str]:
    return sorted(p.rstrip("/") for p in listing)


# gcsfs hands aiohttp the whole body as bytes, and aiohttp warns above 1 MiB.
@pytest.mark.filterwarnings("ignore:Sending a large body directly:ResourceWarning")
def test_roundtrip(remote: dict) -> None:
    fs, root = fsspec.core.url_to_fs(remote["url"], **remote["storage_options"])
    data = os.urandom(MiB)
    path = f"{root}/dir/a.bin"
    fs.pipe(path, data)
    assert names(fs.ls(f"{root}/dir")) == [path]
    assert fs.info(path)["size"] == MiB
    assert fs.cat_file(path, start=1000, end=1010) == data[1000:1010]
    assert fs.cat_file(path, start=MiB - 7, end=MiB) == data[-7:]
    fs.rm(path)
    assert not fs.exists(path)


@pytest.mark.parametrize("turn", [1, 2])
def test_each_test_starts_empty(remote: dict, turn: int) -> None:
    fs, root = fsspec.core.url_to_fs(remote["url"], **remote["storage_options"])
    assert fs.ls(root) == []
    fs.pipe(f"{root}/left-over-{turn}", b"x")


def test_webhdfs_protocol(webhdfs: dict) -> None:
    fs, root = fsspec.core.url_to_fs(webhdfs["url"], **webhdfs["storage_options"])
    posts = []
    post = fs.session.post
    fs.session.post = lambda *a, **k: posts.append(1) or post(*a, **k)  # count APPEND bodies
    fs.mkdir(f"{root}/shards")
    big = os.urandom(12 * MiB)
    with fs.open(f"{root}/shards/a.bin", "wb", block_size=5 * MiB) as f:
        for i in range(0, len(big), MiB):
            f.write(big[i : i + MiB])
    assert len(posts) >= 3  # several APPENDs
    fs.pipe(f"{root}/shards/sub/b.bin", b"hello")  # CREATE makes the parents
    assert names(fs.ls(f"{root}/shards")) == [f"{root}/shards/a.bin", f"{root}/shards/sub"]
    assert fs.find(root) == [f"{root}/shards/a.bin", f"{root}/shards/sub/b.bin"]
    assert fs.info(f"{root}/shards/a.bin")["size"] == 12 * MiB
    assert fs.info(f"{root}/shards")["type"] == "directory"
    assert fs.cat(f"{root}/shards/a.bin") == big
    assert fs.cat_file(f"{root}/shards/a.bin", start=5 * MiB - 3, end=5 * MiB + 3) == big[5 * MiB - 3 : 5 * MiB + 3]
    with fs.open(f"{root}/shards/a.bin") as f:
        f.seek(7 * MiB + 1)
        assert f.read(100) == big[7 * MiB + 1 : 7 * MiB + 101]
    assert fs.content_summary(root)["length"] == 12 * MiB + 5
    fs.mv(f"{root}/shards/sub/b.bin", f"{root}/c.bin")
    assert fs.cat(f"{root}/c.bin") == b"hello" and not fs.exists(f"{root}/shards/sub/b.bin")
    with pytest.raises(RuntimeError, match="not empty"):
        fs.rm(f"{root}/shards")  # a non-empty directory needs recursive=True
    fs.rm(f"{root}/shards", recursive=True)
    fs.rm(f"{root}/c.bin")
    assert fs.ls(root) == []
    with pytest.raises(FileNotFoundError):
        fs.cat(f"{root}/missing")
    with pytest.raises(FileNotFoundError):
        fs.info(f"{root}/missing")


def proxied_s3(s3: dict, latency_proxy, **opts):
    """s3's options, with the endpoint behind a new latency proxy, and no client retries."""
    endpoint = s3["storage_options"]["client_kwargs"]["endpoint_url"]
    url, control = latency_proxy(endpoint, **opts)
    options = copy.deepcopy(s3["storage_options"])
    options["client_kwargs"]["endpoint_url"] = url
    options["config_kwargs"] = {"retries": {"total_max_attempts": 1}}
    fs, root = fsspec.core.url_to_fs(s3["url"], **options)
    fs.retries = 1  # s3fs retries again around botocore; see REMOTE-TESTING.md
    return fs, root, control


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Poll `condition()` until it holds: a proxy in its own process gets to it when it runs."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.02)


def timed_ranged_get(fs, path: str) -> float:
    t = time.perf_counter()
    assert len(fs.cat_file(path, start=0, end=1024)) == 1024
    return time.perf_counter() - t


def test_latency_proxy_delays_s3(s3: dict, latency_proxy) -> None:
    direct, root = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    direct.pipe(f"{root}/a.bin", os.urandom(MiB))
    fs, root, control = proxied_s3(s3, latency_proxy, latency_ms=50)
    timed_ranged_get(fs, f"{root}/a.bin")  # warm: the first request also builds the client
    assert timed_ranged_get(fs, f"{root}/a.bin") >= 0.050
    control.set("latency_ms", 120)
    assert timed_ranged_get(fs, f"{root}/a.bin") >= 0.120
    stats = control.stats()
    assert stats["connections"] >= 3 and stats["bytes"] >= 3 * 1024 and stats["resets"] == 0


def test_latency_proxy_reset_fails_a_get(s3: dict, latency_proxy) -> None:
    direct, root = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    direct.pipe(f"{root}/a.bin", os.urandom(MiB))
    fs, root, control = proxied_s3(s3, latency_proxy, reset_prob=1, reset_max_bytes=1000, seed=1)
    # RST within the headers: botocore's EndpointConnectionError; within the body: aiohttp's ClientPayloadError
    with pytest.raises((aiohttp.ClientError, botocore.exceptions.BotoCoreError, OSError)):
        fs.cat_file(f"{root}/a.bin", start=0, end=MiB)
    assert control.stats()["resets"] >= 1
    control.set("reset_prob", 0)
    assert len(fs.cat_file(f"{root}/a.bin", start=0, end=MiB)) == MiB


@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_latency_proxy_throttles_as_the_store_would(store: str, request: pytest.FixtureRequest, latency_proxy) -> None:
    """S3 answers too many requests with 503 SlowDown, GCS with 429 rateLimitExceeded; a
    storm throttles for a while, then the old setting is back."""
    remote = request.getfixturevalue(store)
    direct, root = fsspec.core.url_to_fs(remote["url"], **remote["storage_options"])
    direct.pipe(f"{root}/a.bin", b"x" * 1000)
    server = remote["storage_options"].get("endpoint_url") or remote["storage_options"]["client_kwargs"]["endpoint_url"]
    url, control = latency_proxy(server, throttle_status=503 if store == "s3" else 429)
    port = int(url.rsplit(":", 1)[1])
    control.storm(3, 1.0)  # long enough for the two requests below on a loaded machine
    for method, expect in (("GET", b"SlowDown" if store == "s3" else b"rateLimitExceeded"), ("HEAD", b"")):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"{method} /{root}/a.bin HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = b"".join(iter(lambda: s.recv(65536), b""))  # then closed
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503 " if store == "s3" else b"HTTP/1.1 429 ")
        assert (expect in body) if expect else body == b""
    assert control.stats()["throttled"] == 2
    wait_for(lambda: control.stats()["throttle_prob"] == 0, "the storm is over")
    opts = copy.deepcopy(remote["storage_options"])
    if store == "s3":
        opts["client_kwargs"]["endpoint_url"] = url
    else:
        opts["endpoint_url"] = url
    fs, _ = fsspec.core.url_to_fs(remote["url"], **opts)
    assert fs.cat_file(f"{root}/a.bin", start=0, end=10) == b"x" * 10


def test_latency_proxy_stall_and_reset_all(s3_server: str, latency_proxy) -> None:
    url, control = latency_proxy(s3_server, stall_prob=1)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /moto-api/ HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(lambda: control.stats()["stalls"] >= 1, "the answer stalled")  # moto answered, the proxy kept it
        s.settimeout(0.3)
        with pytest.raises(socket.timeout):
            s.recv(1)  # black-holed
    assert control.stats()["stalls"] == 1
    wait_for(lambda: control.stats()["active"] == 0, "the proxy saw the client hang up")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /moto-api/ HTTP/1.1\r\n")  # an unfinished request: the connection stays open
        wait_for(lambda: control.stats()["active"] == 1, "the proxy took the connection")
        control.reset_all()
        with pytest.raises(ConnectionResetError):
            s.recv(1)
    with pytest.raises(ValueError, match="unknown"):
        control.set("bogus", 1)


def public(s3: dict, data: bytes) -> str:
    """The path of a new public-read object holding `data`, to GET without signing."""
    direct, root = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    direct.pipe(f"{root}/a.bin", data)
    direct.chmod(f"{root}/a.bin", "public-read")
    return f"/{root}/a.bin"


def gets_through(url: str, path: str, times: int = 1, timeout: float = 60) -> list[float]:
    """GET `path` `times` over one keep-alive connection to `url` (plain HTTP/1.1); each request's seconds,
    to the end of its body."""
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=timeout)
    took = []
    try:
        for _ in range(times):
            t = time.perf_counter()
            conn.request("GET", path)
            answer = conn.getresponse()
            body = answer.read()
            took.append(time.perf_counter() - t)
            assert answer.status == 200 and body, (answer.status, body[:200])
    finally:
        conn.close()
    return took


def test_latency_proxy_caps_a_connection_both_ways(s3: dict, latency_proxy) -> None:
    """conn_mbps is MB (10**6 bytes) a second each way; set at run time, it applies to the next bytes."""
    direct, root = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    data = os.urandom(4_000_000)
    direct.pipe(f"{root}/a.bin", data)
    fs, root, control = proxied_s3(s3, latency_proxy, conn_mbps=2)
    t = time.perf_counter()
    assert fs.cat_file(f"{root}/a.bin") == data
    assert 1.8 <= time.perf_counter() - t < 20  # (4 MB - the 64 KiB burst) / 2 MB/s = 1.97 s
    control.set("conn_mbps", 1)
    t = time.perf_counter()
    fs.pipe(f"{root}/b.bin", data[:1_000_000])
    assert 0.85 <= time.perf_counter() - t < 10  # the upload too: (1 MB - 64 KiB) / 1 MB/s
    stats = control.stats()
    assert stats["conn_mbps"] == 1 and stats["bytes"] >= 4_000_000 and stats["bytes_up"] >= 1_000_000
    assert direct.cat_file(f"{root}/b.bin") == data[:1_000_000]


def test_latency_proxy_more_connections_more_throughput(s3: dict, latency_proxy) -> None:
    """Each connection has a bucket of its own: 10 at once move 10x the bytes of one in the same time."""
    path = public(s3, os.urandom(400_000))
    url, control = latency_proxy(s3["storage_options"]["client_kwargs"]["endpoint_url"], conn_mbps=0.4)
    t = time.perf_counter()
    with ThreadPoolExecutor(10) as pool:
        took = [s for each in pool.map(lambda _: gets_through(url, path), range(10)) for s in each]
    elapsed = time.perf_counter() - t
    assert min(took) >= 0.75  # each: (400 kB - 64 KiB) / 0.4 MB/s = 0.84 s
    assert elapsed < 9  # ~1 s; one cap shared by all ten would take (4 MB - 64 KiB) / 0.4 MB/s = 9.8 s
    stats = control.stats()
    assert stats["connections"] == 10 and stats["responses"] == 10 and stats["bytes"] >= 4_000_000


def test_latency_proxy_tail_holds_chosen_first_bytes(webhdfs: dict, webhdfs_server, latency_proxy) -> None:
    """tail_prob of the responses (each request on a keep-alive connection is one: our WebHDFS server keeps
    connections, moto's does not) wait tail_ms for their first byte; the seeded draws and the counters say which."""
    path = "/webhdfs/v1/data?op=GETFILESTATUS"
    url, control = latency_proxy(webhdfs_server.namenode, tail_prob=1.0, tail_ms=500, seed=1)
    assert min(gets_through(url, path, times=3)) >= 0.49  # one connection, three requests
    stats = control.stats()
    assert (stats["connections"], stats["requests"], stats["responses"], stats["tailed"]) == (1, 3, 3, 3)
    control.set("tail_prob", 0)
    control.set("tail_ms", 30_000)
    gets_through(url, path, times=5, timeout=20)  # a tail would time out
    stats = control.stats()
    assert (stats["requests"], stats["responses"], stats["tailed"]) == (8, 8, 3)
    control.set("tail_prob", 0.5)
    control.set("tail_ms", 100)
    took = gets_through(url, path, times=20)
    tailed = control.stats()["tailed"] - 3
    assert 0 < tailed < 20 and sum(s >= 0.099 for s in took) >= tailed
    assert control.stats()["responses"] == 28


def test_webhdfs_through_proxies(webhdfs: dict, webhdfs_server, latency_proxy) -> None:
    """Both ports proxied; fsspec's data_proxy rewrites the datanode address in the redirects."""
    fs, root = fsspec.core.url_to_fs(webhdfs["url"], **webhdfs["storage_options"])
    data = os.urandom(MiB)
    fs.pipe(f"{root}/a.bin", data)
    nn_url, _ = latency_proxy(webhdfs_server.namenode, latency_ms=30)
    dn_url, dn_control = latency_proxy(webhdfs_server.datanode, latency_ms=30)
    nn_port = nn_url.rsplit(":", 1)[1]
    # the trailing "/" matters: data_proxy is a plain str.replace, and port 4000 is a prefix of 40001
    data_proxy = {webhdfs_server.datanode.split("//")[1] + "/": dn_url.split("//")[1] + "/"}
    pfs, path = fsspec.core.url_to_fs(
        f"webhdfs://127.0.0.1:{nn_port}/data", **webhdfs["storage_options"], data_proxy=data_proxy
    )
    t = time.perf_counter()
    assert pfs.cat_file(f"{path}/a.bin", start=10, end=20) == data[10:20]
    assert time.perf_counter() - t >= 3 * 0.030  # GETFILESTATUS, OPEN (307), then the datanode
    assert dn_control.stats()["bytes"] >= 10


def test_a_server_that_dies_fails_clearly(tmp_path) -> None:
    from servers.fixtures import Server  # not at the top: pytest_plugins must import it first (assert rewriting)

    cmd = [sys.executable, "-c", "import sys; sys.exit('boom: port in use')"]
    server = Server("doomed", cmd, tmp_path / "doomed.log", read_stdout=True)
    try:
        with pytest.raises(pytest.fail.Exception, match="(?s)doomed exited early with code 1.*boom: port in use"):
            server.wait_line()
    finally:
        server.stop()
