"""S3 GETs on blocking HTTP, presigned by botocore's signer alone, straight into a read-ahead
buffer; and a multipart upload's part PUTs the same way, straight from the part's buffer.

s3fs reads a body through aiohttp on its event loop: every chunk becomes a bytes object,
crosses threads and is copied again, which made most of a worker's CPU per MB (profiled with
scripts/profile_remote.py). Here `http.client` reads the body with `readinto`: the kernel copies
the bytes into the buffer the worker parses, and nothing else touches them, as `curl` would.

Nor is s3fs needed to sign: a GET is presigned (SigV4 query auth, `botocore.auth`), so reading
a dataset's index and its shards imports neither s3fs, aiobotocore nor aiohttp (0.3 s of the
process's start, measured) and makes no client and no event loop in each DataLoader worker.
Whether presigned GETs may read a URL is s3_presignable.py's to say, the URLs and their
credentials are s3_signer.py's, the connections (kept per thread) s3_connections.py's;
here the GETs.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import SplitResult, urlsplit

from .patience import patience_for
from .s3_connections import ThreadConnections, close
from .s3_presignable import Target, presignable, resolve
from .s3_signer import Presigner

_PIECE = 256 << 10  # bytes asked of the socket at once: a sample is handed over within ~this many
_ERROR_BODY = 2000  # bytes of an error answer kept for its message
_RELEVANT_ENV = re.compile(r"(AWS_|FSSPEC_|(HTTPS?|NO|ALL)_PROXY$)", re.I)  # what decides how a read goes


class HTTPStatusError(OSError):
    """An S3 answer other than the bytes asked for; `status` is its HTTP status (retry.status_of
    reads it)."""

    def __init__(self, status: int, said: str):
        super().__init__(f"HTTP {status}: {said}")
        self.status = status


def direct_for(url: str, storage_options: dict[str, Any] | None) -> Direct | None:
    """The Direct that reads `url`, or None where s3fs must (see `presignable` and `direct`)."""
    return direct(storage_options) if presignable(url) else None


def path_of(url: str) -> str:
    """bucket/key of an s3:// URL."""
    return url.partition("://")[2]


def usable(storage_options: dict[str, Any] | None) -> bool:
    """Whether reads with these options (and this environment) go through presigned GETs."""
    return direct(storage_options) is not None


def direct(storage_options: dict[str, Any] | None) -> Direct | None:
    """This process's Direct for these options and environment (one signer: credentials
    resolved, regions learnt, shared by its readers and by the DataLoader workers it forks),
    or None where s3fs must read (see `s3_presignable.resolve`)."""
    found = decided(storage_options)
    return found if isinstance(found, Direct) else None


def decided(storage_options: dict[str, Any] | None) -> Direct | str:
    """`direct`'s Direct, or why s3fs reads instead (what `shardkit info -v` and `stats()` say)."""
    env = sorted((k, v) for k, v in os.environ.items() if _RELEVANT_ENV.match(k))
    key = json.dumps([storage_options or {}, env], sort_keys=True, default=repr)
    if key not in _DIRECTS:
        found = resolve(storage_options or {})
        _DIRECTS[key] = Direct(storage_options or {}, *found) if isinstance(found, Target) else found
    return _DIRECTS[key]


_DIRECTS: dict[str, Direct | str] = {}


def _after_fork() -> None:
    """A worker forked while a thread of its parent held a Direct's lock would wait on it forever."""
    for found in _DIRECTS.values():
        if isinstance(found, Direct):
            found._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class Direct(Presigner):
    """GETs of the S3 objects named by bucket/key paths, for one set of storage options."""

    def __init__(self, storage_options: dict[str, Any], endpoint_url: str, region: str, session: Any):
        super().__init__(storage_options, endpoint_url, region, session)
        config = storage_options.get("config_kwargs") or {}
        self._timeout_s = float(config.get("read_timeout") or patience_for("s3://", storage_options).timeout_s)
        self._connections = ThreadConnections(self._timeout_s)

    def _answer(
        self, path: str, headers: dict[str, str], own: bool = False
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a GET of `path` and read its status (`_send`); the whole object (200) for a
        range that starts past its first byte is refused. `own`: on a new connection, not one
        of this thread's kept ones (a body read over many calls)."""
        conn, resp = self._send("GET", path, lambda: self._url(path), headers, own=own)
        if resp.status == 200 and not headers["Range"].startswith("bytes=0-"):
            close(conn, resp)  # the whole object, not the range: its first bytes would come twice
            raise HTTPStatusError(400, f"the server ignored the range {headers['Range']}")
        return conn, resp

    def _send(
        self,
        method: str,
        path: str,
        sign: Callable[[], tuple[str, str]],
        headers: dict[str, str],
        body: memoryview | None = None,
        own: bool = False,
        ok: tuple[int, ...] = (200, 206),
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send `method` to the presigned URL `sign()` gives (and the region it is signed for)
        and read its status: an answer in `ok` is returned; one that names another region for
        the bucket (S3's 301 or 400) is asked again there, signed for it; any other raises
        HTTPStatusError."""
        for _ in range(2):
            url, signed_for = sign()
            u = urlsplit(url)
            conn, resp = self._request(u, method, f"{u.path}?{u.query}" if u.query else u.path, headers, body, own)
            if resp.status in ok:
                return conn, resp
            said = _said(resp.read(_ERROR_BODY))
            close(conn, resp)
            region = resp.getheader("x-amz-bucket-region")
            if resp.status in (301, 307, 400) and region and region != signed_for:
                with self._lock:
                    self._regions[path.partition("/")[0]] = region  # what the URLs are signed for from now on
                continue
            raise HTTPStatusError(resp.status, said)
        raise HTTPStatusError(resp.status, said)

    def _request(
        self, u: SplitResult, method: str, target: str, headers: dict[str, str], body: memoryview | None, own: bool
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """One request and its status line, on a kept connection (one the server has closed
        meanwhile: once more, anew) or, with `own`, a new one. A server that refuses a body
        early (403, 503...) answers, then closes: that answer is read, not taken for a reset."""
        for fresh in (False, True):
            conn = (
                self._connections.new(u.scheme, u.netloc) if own else self._connections.kept(u.scheme, u.netloc, fresh)
            )
            early = None
            try:
                try:
                    conn.request(method, target, body=body, headers=headers)
                except ConnectionError:
                    if body is None or (early := _early_answer(conn)) is None:
                        raise
                return conn, early or conn.getresponse()
            except BaseException as e:
                conn.close()  # reopened by its next request
                if fresh or not isinstance(e, (ConnectionError, http.client.HTTPException)):
                    raise
        raise AssertionError("unreachable")

    def get(
        self,
        path: str,
        start: int,
        stop: int,
        receive: Callable[[Callable[[memoryview], int]], None],
        if_match: str | None = None,
    ) -> int | None:
        """GET bytes [start, stop) of `path`, handing `receive` a `readinto` that fills the
        caller's buffer as bytes arrive; return the object's size where the answer tells it.
        Raises HTTPStatusError for any answer but 206/200 (416: the object ends before `start`)."""
        headers = {"Range": f"bytes={start}-{stop - 1}"}
        if if_match:
            headers["If-Match"] = if_match
        conn, resp = self._answer(path, headers)
        try:
            receive(lambda view: resp.readinto(view[:_PIECE]))  # a body cut short reads as its end: see the size
        except BaseException:
            close(conn, resp)
            raise
        if resp.will_close or not resp.isclosed():  # closed by the server, or bytes past the range left unread
            close(conn, resp)
        total = (
            (resp.getheader("Content-Range") or "").rpartition("/")[2]
            if resp.status == 206
            else resp.getheader("Content-Length") or ""
        )
        return int(total) if total.isdigit() else None

    def put_part(self, path: str, upload_id: str, number: int, body: memoryview) -> str:
        """PUT `body` as part `number` of multipart upload `upload_id` of `path`, straight
        from the caller's buffer (no copy, no payload hash: botocore's path copied each part
        twice and hashed it, ~3 CPU s a GB against ~0.7 here, measured); its ETag. Raises
        HTTPStatusError for any answer but 200 (the caller retries)."""
        conn, resp = self._send(
            "PUT",
            path,
            lambda: self._part_url(path, upload_id, number),
            {"Content-Length": str(len(body))},
            body,
            ok=(200,),
        )
        resp.read()
        if resp.will_close:
            conn.close()
        etag = resp.getheader("ETag")
        if not etag:  # the upload could not be completed without it
            raise HTTPStatusError(502, f"no ETag in the answer to part {number}'s PUT")
        return etag

    def cat(self, path: str) -> bytes:
        """The whole object, in one GET."""
        with contextlib.closing(self.open(path)) as body:
            return body.read()

    def open(self, path: str) -> Body:
        """The object, to read from its start in pieces."""
        return Body(self, path)


class Body:
    """An S3 object read in order, in one GET sent as it is opened (so a missing or forbidden
    object fails there); after a read that fails, the next one asks for the rest (a new GET
    from where the last read ended, If-Match the first answer's ETag), so a retried read loses
    nothing and an object replaced meanwhile fails (412) rather than mixing two versions."""

    def __init__(self, direct: Direct, path: str):
        self._direct, self._path, self._at = direct, path, 0
        self._answered: tuple[http.client.HTTPConnection, http.client.HTTPResponse] | None = None
        self._etag: str | None = None
        self._ended = False
        self._ask()

    def _ask(self) -> None:
        headers = {"Range": f"bytes={self._at}-"}
        if self._etag:
            headers["If-Match"] = self._etag
        try:
            self._answered = _, resp = self._direct._answer(self._path, headers, own=True)
        except HTTPStatusError as e:
            if e.status == 412:
                raise HTTPStatusError(412, f"replaced while it was read (its ETag is no longer {self._etag})") from e
            if e.status != 416:
                raise
            self._ended = True  # nothing from `at` on: an empty object, or asked again at its very end
            return
        self._etag = self._etag or resp.getheader("ETag")

    def read(self, n: int = -1) -> bytes:
        try:
            if self._answered is None and not self._ended:
                self._ask()
            if self._answered is None:
                return b""
            resp = self._answered[1]
            data = resp.read(None if n < 0 else n)
            if not data and n and resp.length:  # a body cut short: http.client's read(n) gives b"" (read() raises)
                raise http.client.IncompleteRead(b"", resp.length)
        except BaseException:
            self.close()
            raise
        self._at += len(data)
        return data

    def close(self) -> None:
        if self._answered is not None:
            close(*self._answered)
            self._answered = None


def _early_answer(conn: http.client.HTTPConnection) -> http.client.HTTPResponse | None:
    """The answer a server sent before it stopped reading a request's body, if it came."""
    try:
        return conn.getresponse()
    except (OSError, http.client.HTTPException):
        return None


def _said(body: bytes) -> str:
    """An S3 error answer in a line: its Code and Message."""
    text = body.decode("utf-8", "replace")
    found = {k: re.search(rf"<{k}>(.*?)</{k}>", text, re.S) for k in ("Code", "Message")}
    if found["Code"]:
        return ": ".join(m.group(1).strip() for m in found.values() if m)
    return text.strip()
