"""S3 range GETs on blocking HTTP, straight into a read-ahead buffer.

s3fs reads a body through aiohttp on its event loop: every chunk becomes a bytes object,
crosses threads and is copied again, which made most of a worker's CPU per MB (profiled with
scripts/profile_remote.py). Here s3fs's client only signs (a presigned URL, made once per
shard every few minutes) and `http.client` reads the body with `readinto`: the kernel copies
the bytes into the buffer the worker parses, and nothing else touches them, as `curl` would.
Connections are kept per thread and reused where the server allows it.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

from .clients import endpoint

PRESIGN_TTL_S = 300.0  # a presigned URL is used this long (it is valid for an hour)
_PIECE = 256 << 10  # bytes asked of the socket at once: a sample is handed over within ~this many
_ERROR_BODY = 600  # bytes of an error answer kept for its message


class HTTPStatusError(OSError):
    """An S3 answer other than the bytes asked for; `status` is its HTTP status (retry.status_of
    reads it)."""

    def __init__(self, status: int, said: str):
        super().__init__(f"HTTP {status}: {said}")
        self.status = status


def usable(storage_options: dict[str, Any] | None) -> bool:
    """Whether the options leave nothing to a request that a presigned GET would not carry:
    a TLS setting of the client's own (verify, a CA bundle), request payer or
    customer-provided keys (headers that must be signed), an HTTP proxy (botocore's
    `proxies`, or HTTP(S)_PROXY for the endpoint's host: botocore honours them, this
    client does not)."""
    opts = storage_options or {}
    client = opts.get("client_kwargs") or {}
    if {"verify", "use_ssl"} & client.keys() or {"requester_pays", "s3_additional_kwargs", "use_ssl"} & opts.keys():
        return False
    if "proxies" in (opts.get("config_kwargs") or {}):
        return False
    url = urlsplit(endpoint(opts) or "https://s3.amazonaws.com")
    return not (getproxies().get(url.scheme) and not proxy_bypass(url.hostname or ""))


class Direct:
    """Range GETs of one S3 filesystem's objects (`fs`: s3fs, for signing only)."""

    def __init__(self, fs: Any):
        self._fs = fs
        self._signed: dict[str, tuple[float, str]] = {}  # path -> (when, presigned URL)
        self._local = threading.local()  # this thread's connections, by (scheme, host)

    def _url(self, path: str) -> str:
        now = time.monotonic()
        when, url = self._signed.get(path, (0.0, ""))
        if now - when > PRESIGN_TTL_S:
            url = self._fs.url(path, expires=int(PRESIGN_TTL_S * 12))
            self._signed[path] = (now, url)
        return url

    def _connection(self, scheme: str, netloc: str, fresh: bool) -> http.client.HTTPConnection:
        pool: dict[tuple[str, str], http.client.HTTPConnection] = self._local.__dict__.setdefault("pool", {})
        conn = pool.get((scheme, netloc))
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            conn = pool[(scheme, netloc)] = kind(netloc, timeout=60)
        return conn

    def get(self, path: str, start: int, stop: int, receive: Callable[[Callable[[memoryview], int]], None],
            if_match: str | None = None) -> None:
        """GET bytes [start, stop) of `path`, handing `receive` a `readinto` that fills the
        caller's buffer as bytes arrive. Raises HTTPStatusError for any answer but 206/200
        (416: the object ends before `start`)."""
        u = urlsplit(self._url(path))
        headers = {"Range": f"bytes={start}-{stop - 1}"}
        if if_match:
            headers["If-Match"] = if_match
        target = f"{u.path}?{u.query}" if u.query else u.path
        for fresh in (False, True):  # a kept connection the server has closed meanwhile: once more, anew
            conn = self._connection(u.scheme, u.netloc, fresh)
            try:
                conn.request("GET", target, headers=headers)
                resp = conn.getresponse()
                break
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                conn.close()
                if fresh:
                    raise
        try:
            if resp.status not in (200, 206):
                raise HTTPStatusError(resp.status, resp.read(_ERROR_BODY).decode("utf-8", "replace").strip())
            if resp.status == 200 and start > 0:  # the whole object, not the range
                raise HTTPStatusError(400, f"the server ignored the range {headers['Range']}")
            receive(lambda view: resp.readinto(view[:_PIECE]))  # a body cut short raises IncompleteRead
        except BaseException:
            conn.close()
            raise
        if resp.will_close or resp.length:  # closed by the server, or bytes past the range left unread
            conn.close()
