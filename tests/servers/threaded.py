"""HTTP servers of the tests' own, each in a thread of the test process: `serving` a handler
(HTTP or HTTPS), `recording` the requests on their way to a real server, and `self_signed`
certificates for the HTTPS ones."""

from __future__ import annotations

import contextlib
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit


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
