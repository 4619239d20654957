"""A gate of GCS's precondition rules in front of the GCS emulator, which ignores them: the
`gcs_conditional` fixture's (fixtures.py)."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler
from typing import ClassVar
from urllib.parse import parse_qs, quote, unquote, urlsplit


class Preconditions(BaseHTTPRequestHandler):
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
