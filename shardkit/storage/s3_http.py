"""S3 GETs on blocking HTTP, presigned by botocore's signer alone, straight into a read-ahead buffer.

s3fs reads a body through aiohttp on its event loop: every chunk becomes a bytes object,
crosses threads and is copied again, which made most of a worker's CPU per MB (profiled with
scripts/profile_remote.py). Here `http.client` reads the body with `readinto`: the kernel copies
the bytes into the buffer the worker parses, and nothing else touches them, as `curl` would.

Nor is s3fs needed to sign: a GET is presigned (SigV4 query auth, `botocore.auth`), so reading
a dataset's index and its shards imports neither s3fs, aiobotocore nor aiohttp (0.3 s of the
process's start, measured) and makes no client and no event loop in each DataLoader worker.
Credentials are resolved as botocore resolves them (the options', then AWS_* variables, then
botocore's own chain: profiles, SSO, instance roles), once a process. Connections are kept
per thread and reused where the server allows it.
"""

from __future__ import annotations

import functools
import http.client
import importlib.util
import json
import os
import re
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import quote, urlsplit
from urllib.request import getproxies, proxy_bypass

from .clients import endpoint
from .urls import S3, scheme

PRESIGN_TTL_S = 300.0  # a presigned URL is used this long (it is valid for an hour)
_PIECE = 256 << 10  # bytes asked of the socket at once: a sample is handed over within ~this many
_ERROR_BODY = 2000  # bytes of an error answer kept for its message
# s3fs options a presigned GET carries, or that concern no read; any other sends reads through s3fs
_OPTIONS = {"key", "secret", "token", "profile", "anon", "endpoint_url", "client_kwargs", "config_kwargs",
            "skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "default_block_size",
            "default_fill_cache", "default_cache_type", "max_concurrency"}
_CLIENT_OPTIONS = {"endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")  # botocore's check of a bucket's name
_VIRTUAL_HOSTABLE = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")  # no dots: a wildcard certificate covers it


class HTTPStatusError(OSError):
    """An S3 answer other than the bytes asked for; `status` is its HTTP status (retry.status_of
    reads it)."""

    def __init__(self, status: int, said: str):
        super().__init__(f"HTTP {status}: {said}")
        self.status = status


class Credentials(NamedTuple):
    """What botocore's signer reads of a credentials object."""

    access_key: str
    secret_key: str
    token: str | None


def usable(storage_options: dict[str, Any] | None) -> bool:
    """Whether a presigned GET of our own carries everything the options ask of a read:
    credentials, a profile or none (anon), an endpoint, a region, path or virtual addressing.
    Not a TLS setting of the client's own (verify, a CA bundle), request payer, customer keys,
    FIPS or dual-stack endpoints, a proxy (botocore's `proxies`, or HTTP(S)_PROXY for the
    endpoint's host), nor any option this module does not know: those reads go through s3fs."""
    opts = storage_options or {}
    client = opts.get("client_kwargs") or {}
    config = opts.get("config_kwargs") or {}
    if not (opts.keys() <= _OPTIONS and client.keys() <= _CLIENT_OPTIONS):
        return False
    key, secret, _ = _given(opts)
    if bool(key) != bool(secret) or "proxies" in config or set(config.get("s3") or {}) - {"addressing_style"}:
        return False
    if config.get("signature_version") not in (None, "s3v4") or any(
            os.environ.get(f"AWS_USE_{v}_ENDPOINT", "").lower() == "true" for v in ("FIPS", "DUALSTACK")):
        return False
    url = urlsplit(_endpoint(opts) or "https://s3.amazonaws.com")
    return _botocore() and not (getproxies().get(url.scheme) and not proxy_bypass(url.hostname or ""))


@functools.cache
def _botocore() -> bool:
    """Whether the signer is installed (with shardkit[s3]; else s3fs's path names the extra)."""
    return importlib.util.find_spec("botocore") is not None


def presignable(url: str) -> bool:
    """Whether `url` is an S3 object of a bucket named plainly: an access point's ARN, or a
    name botocore refuses, is left to s3fs."""
    bucket = url.partition("://")[2].partition("/")[0]
    return scheme(url) in S3 and "::" not in url and bool(_BUCKET.fullmatch(bucket))


def _given(opts: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    client = opts.get("client_kwargs") or {}
    return (opts.get("key") or client.get("aws_access_key_id"), opts.get("secret") or client.get("aws_secret_access_key"),
            opts.get("token") or client.get("aws_session_token"))


def _endpoint(opts: dict[str, Any]) -> str:
    """The options' endpoint, else the environment's (botocore reads these too)."""
    return endpoint(opts) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""


def direct(storage_options: dict[str, Any] | None) -> Direct:
    """This process's Direct for these options: one signer (credentials resolved, regions
    learnt) shared by its readers, and by the DataLoader workers it forks."""
    key = json.dumps(storage_options or {}, sort_keys=True, default=repr)
    return _DIRECTS.get(key) or _DIRECTS.setdefault(key, Direct(storage_options or {}))


_DIRECTS: dict[str, Direct] = {}  # by storage options


class Direct:
    """GETs of the S3 objects named by bucket/key paths, for one set of storage options."""

    def __init__(self, storage_options: dict[str, Any]):
        opts = storage_options
        self._given = _given(opts)
        self._anon = bool(opts.get("anon"))
        self._profile = opts.get("profile")
        self._endpoint = _endpoint(opts)
        self._style = ((opts.get("config_kwargs") or {}).get("s3") or {}).get("addressing_style", "auto")
        self._region = (opts.get("client_kwargs") or {}).get("region_name")
        self._regions: dict[str, str] = {}  # bucket -> the region S3 said it is in
        self._signed: dict[str, tuple[float, str]] = {}  # path -> (when, presigned URL)
        self._lock = threading.Lock()
        self._local = threading.local()  # this thread's connections, by (scheme, host), and its process

    @functools.cached_property
    def _session(self) -> Any:
        """botocore's session, for what the options and environment leave to it: credentials
        from its chain, the region from a profile."""
        import botocore.session

        return botocore.session.Session(profile=self._profile)

    def _credentials(self) -> Any:
        key, secret, token = self._given
        if key and secret:
            return Credentials(key, secret, token)
        env = os.environ
        if not self._profile and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            return Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_SESSION_TOKEN"))
        found = self._session.get_credentials()
        if found is None:
            import botocore.exceptions

            raise botocore.exceptions.NoCredentialsError()
        return found.get_frozen_credentials()  # refreshed by botocore when they are about to expire

    @functools.cached_property
    def _default_region(self) -> str:
        env = os.environ
        region = self._region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        if not region and (self._profile or os.path.exists(os.path.expanduser(
                env.get("AWS_CONFIG_FILE", "~/.aws/config")))):
            region = self._session.get_config_variable("region")
        return str(region or "us-east-1")

    def _object_url(self, bucket: str, key: str) -> str:
        """Path-style on an endpoint of the options' (what S3-compatible stores all serve),
        virtual-hosted on AWS's where the bucket's name allows, as botocore addresses them."""
        quoted = quote(key, safe="/~")
        if self._endpoint:
            u = urlsplit(self._endpoint)
            base = u.path.rstrip("/")
            if self._style == "virtual":
                return f"{u.scheme}://{bucket}.{u.netloc}{base}/{quoted}"
            return f"{u.scheme}://{u.netloc}{base}/{bucket}/{quoted}"
        host = f"s3.{self._regions.get(bucket, self._default_region)}.amazonaws.com"
        if self._style != "path" and _VIRTUAL_HOSTABLE.fullmatch(bucket):
            return f"https://{bucket}.{host}/{quoted}"
        return f"https://{host}/{bucket}/{quoted}"

    def _url(self, path: str) -> str:
        now = time.monotonic()
        signed = self._signed.get(path)
        if signed is not None and now - signed[0] <= PRESIGN_TTL_S:
            return signed[1]
        bucket, _, key = path.partition("/")
        url = self._object_url(bucket, key)
        if not self._anon:
            from botocore.auth import S3SigV4QueryAuth
            from botocore.awsrequest import AWSRequest

            request = AWSRequest(method="GET", url=url)
            region = self._regions.get(bucket, self._default_region)
            S3SigV4QueryAuth(self._credentials(), "s3", region, expires=int(PRESIGN_TTL_S * 12)).add_auth(request)
            url = request.url
        with self._lock:
            self._signed[path] = (now, url)
        return url

    def _connection(self, scheme: str, netloc: str, fresh: bool) -> http.client.HTTPConnection:
        if getattr(self._local, "pid", None) != os.getpid():  # a forked worker: not its parent's sockets
            self._local.pid, self._local.pool = os.getpid(), {}
        pool: dict[tuple[str, str], http.client.HTTPConnection] = self._local.pool
        conn = pool.get((scheme, netloc))
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = pool[(scheme, netloc)] = _connect(scheme, netloc)
        return conn

    def _answer(self, path: str, headers: dict[str, str], own: bool = False) -> tuple[http.client.HTTPConnection,
                                                                                      http.client.HTTPResponse]:
        """Send a GET of `path` and read its status; an answer that names another region for
        the bucket (S3's 301 or 400) is asked again there, signed for it. `own`: on a new
        connection, not one of this thread's kept ones (a body read over many calls)."""
        for _ in range(2):
            u = urlsplit(self._url(path))
            target = f"{u.path}?{u.query}" if u.query else u.path
            for fresh in (False, True):  # a kept connection the server has closed meanwhile: once more, anew
                conn = _connect(u.scheme, u.netloc) if own else self._connection(u.scheme, u.netloc, fresh)
                try:
                    conn.request("GET", target, headers=headers)
                    resp = conn.getresponse()
                    break
                except BaseException as e:
                    conn.close()  # reopened by its next request
                    if fresh or not isinstance(e, (ConnectionError, http.client.HTTPException)):
                        raise
            if resp.status in (200, 206):
                return conn, resp
            said = _said(resp.read(_ERROR_BODY))
            conn.close()
            bucket = path.partition("/")[0]
            region = resp.getheader("x-amz-bucket-region")
            if resp.status in (301, 307, 400) and region and region != self._regions.get(bucket, self._default_region):
                with self._lock:
                    self._regions[bucket] = region
                    self._signed = {p: s for p, s in self._signed.items() if not p.startswith(bucket + "/")}
                continue
            raise HTTPStatusError(resp.status, said)
        raise HTTPStatusError(resp.status, said)

    def get(self, path: str, start: int, stop: int, receive: Callable[[Callable[[memoryview], int]], None],
            if_match: str | None = None) -> int | None:
        """GET bytes [start, stop) of `path`, handing `receive` a `readinto` that fills the
        caller's buffer as bytes arrive; return the object's size where the answer tells it.
        Raises HTTPStatusError for any answer but 206/200 (416: the object ends before `start`)."""
        headers = {"Range": f"bytes={start}-{stop - 1}"}
        if if_match:
            headers["If-Match"] = if_match
        conn, resp = self._answer(path, headers)
        try:
            if resp.status == 200 and start > 0:  # the whole object, not the range
                raise HTTPStatusError(400, f"the server ignored the range {headers['Range']}")
            receive(lambda view: resp.readinto(view[:_PIECE]))  # a body cut short reads as its end: see the size
        except BaseException:
            conn.close()
            raise
        if resp.will_close or resp.length:  # closed by the server, or bytes past the range left unread
            conn.close()
        total = (resp.getheader("Content-Range") or "").rpartition("/")[2] if resp.status == 206 else \
            resp.getheader("Content-Length") or ""
        return int(total) if total.isdigit() else None

    def cat(self, path: str) -> bytes:
        """The whole object, in one GET."""
        conn, resp = self._answer(path, {})
        try:
            data = resp.read()  # a body cut short raises IncompleteRead
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        return data

    def open(self, path: str) -> Body:
        """The object, to read from its start in pieces."""
        return Body(self, path)


class Body:
    """An S3 object read in order, in one GET sent as it is opened (so a missing or forbidden
    object fails there); after a read that fails, the next one asks for the rest (a new GET
    from where the last read ended), so a retried read loses nothing."""

    def __init__(self, direct: Direct, path: str):
        self._direct, self._path, self._at = direct, path, 0
        self._answered: tuple[http.client.HTTPConnection, http.client.HTTPResponse] | None = None
        self._ended = False
        self._ask()

    def _ask(self) -> None:
        try:
            self._answered = self._direct._answer(self._path, {"Range": f"bytes={self._at}-"}, own=True)
        except HTTPStatusError as e:
            if e.status != 416:
                raise
            self._ended = True  # nothing from `at` on: an empty object, or asked again at its very end

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
            self._answered[0].close()
            self._answered = None


def _connect(scheme: str, netloc: str) -> http.client.HTTPConnection:
    """A connection to S3, its TLS verified against AWS_CA_BUNDLE where set, as botocore's is."""
    if scheme != "https":
        return http.client.HTTPConnection(netloc, timeout=60)
    return http.client.HTTPSConnection(netloc, timeout=60, context=_tls(os.environ.get("AWS_CA_BUNDLE")))


@functools.cache
def _tls(ca_bundle: str | None) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_bundle)


def _said(body: bytes) -> str:
    """An S3 error answer in a line: its Code and Message."""
    text = body.decode("utf-8", "replace")
    found = {k: re.search(rf"<{k}>(.*?)</{k}>", text, re.S) for k in ("Code", "Message")}
    if found["Code"]:
        return ": ".join(m.group(1).strip() for m in found.values() if m)
    return text.strip()
