"""pytest plugin: real storage servers on loopback, for tests that talk to S3, GCS or WebHDFS.

Load it with ``pytest_plugins = ["servers"]`` (or ``-p servers``).  Each server is one subprocess
per session, started on first use on a free 127.0.0.1 port and stopped at the end (terminate,
5 s, kill); the function-scoped fixtures wipe its state and hand out a fresh bucket or directory::

    def test_x(remote):                      # runs over s3, gcs, webhdfs and azure
        fs, path = fsspec.core.url_to_fs(remote["url"], **remote["storage_options"])

Servers: moto (S3), gcp-storage-emulator (GCS), ``scripts/webhdfs_server.py`` (WebHDFS) and
``scripts/latency_proxy.py`` (delay, latency tail, per-connection bandwidth cap, RST, stall and
throttling faults in front of any of them); ``gcs_conditional`` puts a gate of GCS's
precondition rules (``ifGenerationMatch``, which the emulator ignores) in front of the emulator.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import IO, Any, Callable, ClassVar, Iterator, NamedTuple
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # read by gcsfs at import

import pytest

BIN = Path(sys.executable).parent
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
BUCKET = "shardkit-test"
READY_S = 30.0
PROXY_OPTIONS = (
    "conn_mbps",
    "tail_prob",
    "tail_ms",
    "reset_prob",
    "reset_max_bytes",
    "stall_prob",
    "throttle_prob",
    "throttle_status",
    "seed",
)

# Run a command so that the kernel SIGTERMs it when the test process dies (Linux): even a pytest
# killed with SIGKILL leaves no server behind.
_DIE_WITH_PARENT = """import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("parent already gone")
os.execv(sys.argv[2], sys.argv[2:])
"""


class Server:
    """One server subprocess; stderr (and stdout, unless read for a ready line) go to a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path, read_stdout: bool = False) -> None:
        if not Path(cmd[0]).exists():
            hint = "pip install s3fs 'moto[server]' gcsfs gcp-storage-emulator"
            pytest.fail(f"{name}: {cmd[0]} not found; install the test servers: {hint}", pytrace=False)
        self.name, self.log_path = name, log
        self.log: IO[bytes] = open(log, "wb")
        if sys.platform.startswith("linux"):
            cmd = [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if read_stdout else self.log, stderr=self.log
        )
        self.deadline = time.monotonic() + READY_S

    def check(self) -> None:
        """Fail the test, with the server's log, if the server is gone."""
        if self.proc.poll() is not None:
            self.fail(f"exited early with code {self.proc.returncode}")

    def fail(self, why: str) -> None:
        self.log.flush()
        tail = self.log_path.read_bytes()[-3000:].decode("utf-8", "replace")
        pytest.fail(f"{self.name} {why}; its log {self.log_path} ends with:\n{tail}", pytrace=False)

    def wait_http(self, url: str) -> None:
        """Poll url until any HTTP answer (an error status counts) comes back."""
        while True:
            self.check()
            try:
                urllib.request.urlopen(url, timeout=1).close()
                return
            except urllib.error.HTTPError as e:
                e.close()
                return
            except OSError:
                pass
            if time.monotonic() > self.deadline:
                self.fail(f"did not answer {url} within {READY_S:.0f} s")
            time.sleep(0.05)

    def wait_line(self) -> list[str]:
        """Wait for the 'ready ...' line on stdout; return its words after 'ready'."""
        assert self.proc.stdout is not None
        while not select.select([self.proc.stdout], [], [], 0.1)[0]:
            self.check()
            if time.monotonic() > self.deadline:
                self.fail(f"printed no ready line within {READY_S:.0f} s")
        words = self.proc.stdout.readline().decode().split()
        if not words:  # EOF: it is exiting
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            self.check()
        if not words or words[0] != "ready":
            self.fail(f"printed {' '.join(words)!r} instead of a ready line")
        return words[1:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> bytes:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


@pytest.fixture(scope="session")
def _server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


def _holds_port(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on 127.0.0.1:`port` (True where /proc
    cannot tell: not Linux)."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return True
    wanted = {f"socket:[{f[9]}]" for f in map(str.split, lines) if f[1] == f"0100007F:{port:04X}" and f[3] == "0A"}
    held = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            held.add(os.readlink(fd))
    return bool(wanted & held)


def _serve_http(name: str, cmd: Callable[[int], list[str]], probe: str, logs: Path) -> Iterator[tuple[Server, str]]:
    """A server on a free port that answers `probe`. free_port() closes its socket before the
    server binds: another process (another pytest-xdist worker's server) may take the port in
    between, and answer the probe in its stead, so the port must be the server's own."""
    for _ in range(3):
        port = free_port()
        server = Server(name, cmd(port), logs / f"{name}.log")
        try:
            url = f"http://127.0.0.1:{port}"
            server.wait_http(url + probe)
            if _holds_port(server.proc.pid, port):
                yield server, url
                return
        finally:
            server.stop()
    pytest.fail(f"{name}: its free port was taken by another process, 3 times", pytrace=False)


# -- S3: moto in server mode ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def _moto(_server_logs: Path) -> Iterator[tuple[Server, str]]:
    cmd = lambda port: [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]  # noqa: E731
    yield from _serve_http("moto_server", cmd, "/moto-api/", _server_logs)


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
    yield from _serve_http("gcp-storage-emulator", cmd, "/storage/v1/b", _server_logs)


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


class _Preconditions(BaseHTTPRequestHandler):
    """In front of the GCS emulator, which ignores `ifGenerationMatch`: a request that carries
    it (an upload, a delete) is answered 412 where the object's generation is another (0: no
    object), as GCS does, and passed on otherwise, one at a time; everything else passes on."""

    upstream: ClassVar[tuple[str, int]]
    one_at_a_time: ClassVar[threading.Lock] = threading.Lock()
    protocol_version = "HTTP/1.1"

    def _pass(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        wanted = query.get("ifGenerationMatch", [None])[0]
        with self.one_at_a_time if wanted is not None else contextlib.nullcontext():
            if wanted is not None and self._generation(parts.path, query) != wanted:
                return self._answer(
                    412,
                    json.dumps({"error": {"code": 412, "message": "conditionNotMet"}}).encode(),
                    {"Content-Type": "application/json"},
                )
            status, headers, data = self._ask(self.command, self.path, body)
        self._answer(status, data, headers)

    def _generation(self, path: str, query: dict[str, list[str]]) -> str:
        """The generation of the object a request names ("0": none)."""
        if path.startswith("/upload/"):  # /upload/storage/v1/b/BUCKET/o?name=KEY
            bucket, key = path.split("/")[5], query["name"][0]
        else:  # /storage/v1/b/BUCKET/o/KEY
            bucket, key = path.split("/")[4], unquote(path.split("/o/", 1)[1])
        status, _, data = self._ask("GET", f"/storage/v1/b/{bucket}/o/{quote(key, safe='')}", b"")
        return str(json.loads(data)["generation"]) if status == 200 else "0"

    def _ask(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        import http.client

        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            skip = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
            headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
            conn.request(method, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            kept = {k: v for k, v in resp.getheaders() if k.lower() not in skip}
            return resp.status, kept, data
        finally:
            conn.close()

    def _answer(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gcs_conditional(gcs: dict, gcs_server: str) -> Iterator[dict]:
    """`gcs` as seen through `_Preconditions`: a bucket where uploads and deletes with
    ifGenerationMatch hold to GCS's rules (the emulator alone ignores them)."""
    u = urlsplit(gcs_server)
    gate = type("Gate", (_Preconditions,), {"upstream": (u.hostname, u.port)})
    with serving(gate) as base:
        yield {"url": gcs["url"], "storage_options": {**gcs["storage_options"], "endpoint_url": base}}


# -- WebHDFS: scripts/webhdfs_server.py over a local directory -----------------------------------
class WebHDFSServer(NamedTuple):
    namenode: str  # http://127.0.0.1:NN: clients talk here, and are redirected (307) to...
    datanode: str  # http://127.0.0.1:DN: ...here, for the bytes of CREATE, APPEND and OPEN
    root: Path  # the local directory that holds the tree
    server: Server


@pytest.fixture(scope="session")
def webhdfs_server(_server_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebHDFSServer]:
    """A WebHDFS namenode + datanode (one per session) over a local directory."""
    root = tmp_path_factory.mktemp("webhdfs-root")
    cmd = [sys.executable, str(SCRIPTS / "webhdfs_server.py"), str(root), "--port", "0", "--data-port", "0"]
    server = Server("webhdfs_server", cmd, _server_logs / "webhdfs_server.log", read_stdout=True)
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
@pytest.fixture(params=["s3", "gcs", "webhdfs", "seaweedfs", "fakegcs", "azure"])  # seaweed.py, fakegcs.py, azurite.py
def remote(request: pytest.FixtureRequest) -> dict:
    """Each of s3, gcs, webhdfs, SeaweedFS's S3, fake-gcs-server and azure (Azurite) in turn:
    {"url": ..., "storage_options": {...}}."""
    return request.getfixturevalue(request.param)


# -- faults: scripts/latency_proxy.py ------------------------------------------------------------
class ProxyControl:
    """Talks to a running latency proxy's control port (one line per connection)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def _send(self, line: str) -> str:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s, s.makefile("rb") as f:
            s.sendall(line.encode() + b"\n")
            answer = f.readline().decode().strip()
        if answer.startswith("error") or not answer:
            raise ValueError(f"latency proxy: {line!r} -> {answer!r}")
        return answer

    def set(self, name: str, value: float) -> None:
        """name: latency_ms, conn_mbps, tail_prob, tail_ms, reset_prob, reset_max_bytes, stall_prob, throttle_prob
        or throttle_status."""
        self._send(f"set {name} {value}")

    def storm(self, seconds: float, prob: float) -> None:
        """Throttle (503 or 429, as throttle_status says) `prob` of the GETs for `seconds`."""
        self._send(f"storm {seconds} {prob}")

    def reset_all(self) -> None:
        """Send an RST to every live client connection."""
        self._send("reset_all")

    def stats(self) -> dict:
        """Counters (connections, active, resets, stalls, throttled, requests, responses, tailed, bytes, bytes_up)
        and current settings."""
        return json.loads(self._send("stats"))


@pytest.fixture(scope="session")
def latency_proxy(_server_logs: Path) -> Iterator[Callable[..., tuple[str, ProxyControl]]]:
    """A factory: start(upstream_url, latency_ms=0, conn_mbps=, tail_prob=, tail_ms=, reset_prob=, ..., seed=)
    -> (the same URL through a new proxy, its ProxyControl).  Every proxy stops at session end."""
    started: list[Server] = []

    def start(upstream_url: str, latency_ms: float = 0, **opts: float) -> tuple[str, ProxyControl]:
        if unknown := set(opts) - set(PROXY_OPTIONS):
            raise TypeError(f"unknown proxy options {sorted(unknown)}; known: {PROXY_OPTIONS}")
        u = urlsplit(upstream_url)
        cmd = [
            sys.executable,
            str(SCRIPTS / "latency_proxy.py"),
            "--upstream",
            f"{u.hostname}:{u.port}",
            "--latency-ms",
            str(latency_ms),
        ]
        for k, v in opts.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        server = Server("latency_proxy", cmd, _server_logs / f"latency_proxy{len(started)}.log", read_stdout=True)
        started.append(server)
        port, cport = server.wait_line()
        return urlunsplit(u._replace(netloc=f"127.0.0.1:{port}")), ProxyControl(int(cport))

    try:
        yield start
    finally:
        for server in started:
            server.stop()


# -- HTTP servers of our own, in a thread --------------------------------------------------------
@contextlib.contextmanager
def serving(handler: Callable[..., Any], tls: tuple[str, str] | None = None) -> Iterator[str]:
    """The base URL of a threading HTTP server on a free loopback port answering with
    `handler` (a BaseHTTPRequestHandler class, or a partial of one), shut down on exit;
    HTTPS with `tls` = (certificate file, key file)."""
    import ssl
    import threading
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def recording(
    upstream: str, note: Callable[[BaseHTTPRequestHandler], dict], upstream_host: bool = False
) -> Iterator[tuple[str, list[dict]]]:
    """(the URL of a server that forwards every request to `upstream`, the list of `note(request)`
    of each request it forwarded, in order). `upstream_host`: the requests reach `upstream` under
    its own Host (a GCS emulator takes another host for a bucket's name), else under theirs (an
    S3 signature covers it)."""
    import http.client

    seen: list[dict] = []
    netloc = urlsplit(upstream).netloc

    class Recording(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            seen.append(note(self))
            conn = http.client.HTTPConnection(netloc, timeout=30)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if not (upstream_host and k.lower() == "host")}
            if upstream_host:
                headers["Host"] = netloc
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that had what it wanted
                    self.wfile.write(data)
            conn.close()

        do_GET = do_HEAD = do_PUT = do_POST = _forward

        def log_message(self, *args: object) -> None:
            pass

    with serving(Recording) as base:
        yield base, seen


def self_signed(folder: Path) -> tuple[str, str]:
    """(certificate file, key file) of a self-signed certificate for 127.0.0.1."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(folder / "cert.pem"), str(folder / "key.pem")


@pytest.fixture
def forbidding() -> Iterator[tuple[str, list[str]]]:
    """(endpoint URL, request log) of an HTTP server on loopback that answers every request
    403 Forbidden, as S3 (XML) or GCS (JSON) does for credentials without access."""
    from http.server import BaseHTTPRequestHandler

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
