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

import contextlib
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

from .clients import endpoint, env_endpoint
from .patience import OPTIONS, patience_for
from .urls import S3, scheme

PRESIGN_TTL_S = 300.0  # a presigned URL is used this long (it is valid for an hour)
_SIGNED_KEPT = 4096  # presigned URLs kept a process (~1 KB each): past this, the stale ones go
_PIECE = 256 << 10  # bytes asked of the socket at once: a sample is handed over within ~this many
_ERROR_BODY = 2000  # bytes of an error answer kept for its message
# What a presigned GET of ours carries, or what concerns no read; anything else reads through s3fs
_OPTIONS = {
    "key",
    "secret",
    "token",
    "profile",
    "anon",
    "endpoint_url",
    "client_kwargs",
    "config_kwargs",
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "default_block_size",
    "default_fill_cache",
    "default_cache_type",
    "max_concurrency",
    *OPTIONS,
}
_CLIENT_OPTIONS = {"endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
_CONFIG_OPTIONS = {
    "s3",
    "signature_version",
    "region_name",
    "retries",
    "connect_timeout",
    "read_timeout",
    "max_pool_connections",
    "request_checksum_calculation",
    "response_checksum_validation",
}
# keys of an AWS config profile that choose credentials or concern no request: any other
# (endpoint_url, services, use_fips_endpoint, s3, ca_bundle...) is botocore's to apply, through s3fs
_PROFILE_KEYS = {
    "region",
    "output",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "aws_security_token",
    "role_arn",
    "source_profile",
    "credential_source",
    "role_session_name",
    "external_id",
    "mfa_serial",
    "duration_seconds",
    "web_identity_token_file",
    "credential_process",
    "sso_session",
    "sso_account_id",
    "sso_role_name",
    "sso_region",
    "sso_start_url",
    "sso_registration_scopes",
    "retry_mode",
    "max_attempts",
    "metadata_service_timeout",
    "metadata_service_num_attempts",
    "parameter_validation",
    "tcp_keepalive",
}
_OTHER_PARTITIONS = ("cn-", "us-iso", "eu-iso", "eusc-")  # AWS regions outside *.amazonaws.com
_RELEVANT_ENV = re.compile(r"(AWS_|FSSPEC_|(HTTPS?|NO|ALL)_PROXY$)", re.I)  # what decides how a read goes
_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")  # botocore's check of a bucket's name
_VIRTUAL_HOSTABLE = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")  # no dots: a wildcard certificate covers it


class HTTPStatusError(OSError):
    """An S3 answer other than the bytes asked for; `status` is its HTTP status (retry.status_of
    reads it)."""

    def __init__(self, status: int, said: str):
        super().__init__(f"HTTP {status}: {said}")
        self.status = status


class Credentials(NamedTuple):
    """What botocore's signer reads of a credentials object (botocore.credentials, which has
    one, costs 70 ms to import)."""

    access_key: str
    secret_key: str
    token: str | None


def presignable(url: str) -> bool:
    """Whether `url` is an object of an S3 bucket named plainly: an access point's ARN, a
    directory bucket (S3 Express), a name botocore refuses, or a bucket alone is left to s3fs."""
    bucket, _, key = url.partition("://")[2].partition("/")
    return (
        scheme(url) in S3
        and "::" not in url
        and bool(key)
        and bool(_BUCKET.fullmatch(bucket))
        and not bucket.endswith("--x-s3")
    )


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
    or None where s3fs must read (see `_resolve`)."""
    found = decided(storage_options)
    return found if isinstance(found, Direct) else None


def decided(storage_options: dict[str, Any] | None) -> Direct | str:
    """`direct`'s Direct, or why s3fs reads instead (what `shardkit info -v` and `stats()` say)."""
    env = sorted((k, v) for k, v in os.environ.items() if _RELEVANT_ENV.match(k))
    key = json.dumps([storage_options or {}, env], sort_keys=True, default=repr)
    if key not in _DIRECTS:
        _DIRECTS[key] = _resolve(storage_options or {})
    return _DIRECTS[key]


_DIRECTS: dict[str, Direct | str] = {}


def _after_fork() -> None:
    """A worker forked while a thread of its parent held a Direct's lock would wait on it forever."""
    for found in _DIRECTS.values():
        if isinstance(found, Direct):
            found._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _resolve(opts: dict[str, Any]) -> Direct | str:
    """A Direct where a presigned GET of ours goes where s3fs's client would and carries all it
    would: credentials, a profile or none (anon), an endpoint, a region, path or virtual
    addressing. Else why not, for what only botocore's client applies: an option this module
    does not know, a TLS setting of the client's own (verify), request payer, FIPS, dual-stack
    or accelerated endpoints, a partition outside amazonaws.com, an endpoint or S3 setting in
    the AWS config profile, fsspec's own S3 configuration, a proxy for the store's host."""
    client, config = opts.get("client_kwargs") or {}, opts.get("config_kwargs") or {}
    if not _botocore():
        return "botocore is not installed"
    unknown = sorted(
        {
            *(opts.keys() - _OPTIONS),
            *(f"client_kwargs.{k}" for k in client.keys() - _CLIENT_OPTIONS),
            *(f"config_kwargs.{k}" for k in config.keys() - _CONFIG_OPTIONS),
            *(f"config_kwargs.s3.{k}" for k in set(config.get("s3") or {}) - {"addressing_style"}),
        }
    )
    if config.get("signature_version") not in (None, "s3v4"):
        unknown.append("config_kwargs.signature_version")
    if unknown:
        return f"the options set {', '.join(unknown)}, which botocore's client applies"
    key, secret, _ = _given(opts)
    env = os.environ
    if bool(key) != bool(secret):
        return "the options give a key without a secret, or a secret without a key"
    for variable in ("AWS_USE_FIPS_ENDPOINT", "AWS_USE_DUALSTACK_ENDPOINT"):
        if env.get(variable, "").lower() == "true":
            return f"{variable} is set"
    if _fsspec_configures_s3():
        return "fsspec's configuration may give s3fs options (FSSPEC_S3* variables or files in its config folder)"
    url = endpoint(opts) or env_endpoint()
    region = client.get("region_name") or config.get("region_name") or env.get("AWS_DEFAULT_REGION")
    session = None
    if (
        opts.get("profile")
        or env.get("AWS_PROFILE")
        or os.path.exists(os.path.expanduser(env.get("AWS_CONFIG_FILE", "~/.aws/config")))
    ):
        import botocore.exceptions
        import botocore.session

        session = botocore.session.Session(profile=opts.get("profile"))
        try:
            profile = session.get_scoped_config()
        except botocore.exceptions.BotoCoreError:  # a profile that is not there: s3fs names it
            return "the AWS profile named is not there"
        if profile.keys() - _PROFILE_KEYS:
            return f"the AWS config profile sets {', '.join(sorted(profile.keys() - _PROFILE_KEYS))}"
        region = region or profile.get("region")
    region = str(region or "us-east-1")
    target = urlsplit(url or f"https://bucket.s3.{region}.amazonaws.com")
    if target.scheme not in ("http", "https") or not target.hostname:
        return f"the endpoint {url!r} is not an http(s) URL"  # botocore's "Invalid endpoint"
    if not url and region.startswith(_OTHER_PARTITIONS):
        return f"region {region} is outside amazonaws.com"
    if getproxies().get(target.scheme) and not proxy_bypass(target.hostname):
        return f"a proxy is set for {target.scheme}://{target.hostname}"
    return Direct(opts, url, region, session)


def unapplied(opts: dict[str, Any]) -> str:
    """What of these options, or of this environment, keeps presigned GETs out (for a message)."""
    client, config = opts.get("client_kwargs") or {}, opts.get("config_kwargs") or {}
    keys = (
        sorted(opts.keys() - _OPTIONS)
        + sorted(f"client_kwargs.{k}" for k in client.keys() - _CLIENT_OPTIONS)
        + sorted(f"config_kwargs.{k}" for k in config.keys() - _CONFIG_OPTIONS)
    )
    if keys:
        return f"the storage option(s) {', '.join(keys)}"
    return (
        "these storage options or this environment (a setting only botocore's client applies: a profile's "
        "endpoint or S3 settings, FIPS or dual-stack endpoints, fsspec's S3 configuration, a proxy)"
    )


def _fsspec_configures_s3() -> bool:
    """Whether fsspec's configuration (FSSPEC_S3* variables, files in its config folder) may
    give s3fs options of its own, which reads through s3fs would apply."""
    folder = os.environ.get("FSSPEC_CONFIG_DIR") or os.path.expanduser("~/.config/fsspec")
    return any(k.upper().startswith("FSSPEC_S3") for k in os.environ) or (
        os.path.isdir(folder) and any(name.endswith((".json", ".ini")) for name in os.listdir(folder))
    )


@functools.cache
def _botocore() -> bool:
    """Whether the signer is installed (with shardkit[s3]; else s3fs's path names the extra)."""
    return importlib.util.find_spec("botocore") is not None


def _given(opts: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    client = opts.get("client_kwargs") or {}
    return (
        opts.get("key") or client.get("aws_access_key_id"),
        opts.get("secret") or client.get("aws_secret_access_key"),
        opts.get("token") or client.get("aws_session_token"),
    )


class Direct:
    """GETs of the S3 objects named by bucket/key paths, for one set of storage options."""

    def __init__(self, storage_options: dict[str, Any], endpoint_url: str, region: str, session: Any):
        opts = storage_options
        self._given = _given(opts)
        self._anon = bool(opts.get("anon"))
        self._profile = opts.get("profile")
        self._endpoint = endpoint_url
        config = opts.get("config_kwargs") or {}
        self._style = (config.get("s3") or {}).get("addressing_style", "auto")
        self._timeout_s = float(config.get("read_timeout") or patience_for("s3://", opts).timeout_s)
        self._default_region = region
        self._session = session  # botocore's, where a profile or config file is there; else made if needed
        self._regions: dict[str, str] = {}  # bucket -> the region S3 said it is in
        self._signed: dict[str, tuple[float, str, str]] = {}  # path -> (when, region, presigned URL)
        self._lock = threading.Lock()
        self._local = threading.local()  # this thread's connections, by (scheme, host), and its process

    def _credentials(self) -> Any:
        """The options' credentials, else AWS_* variables, else botocore's chain (what its
        first provider would read from the environment, read here without importing it)."""
        key, secret, token = self._given
        if key and secret:
            return Credentials(key, secret, token)
        env = os.environ
        if not self._profile and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            return Credentials(
                env["AWS_ACCESS_KEY_ID"],
                env["AWS_SECRET_ACCESS_KEY"],
                env.get("AWS_SESSION_TOKEN") or env.get("AWS_SECURITY_TOKEN"),
            )
        if self._session is None:
            import botocore.session

            self._session = botocore.session.Session(profile=self._profile)
        found = self._session.get_credentials()
        if found is None:
            import botocore.exceptions

            raise botocore.exceptions.NoCredentialsError()
        return found.get_frozen_credentials()  # refreshed by botocore when they are about to expire

    @property
    def region(self) -> str:
        """The region GETs are signed for until S3 names a bucket's own."""
        return self._default_region

    def _region(self, bucket: str) -> str:
        return self._regions.get(bucket, self._default_region)

    def _object_url(self, bucket: str, key: str, region: str) -> str:
        """Path-style on an endpoint of the options' (what S3-compatible stores all serve),
        virtual-hosted on AWS's where the bucket's name allows, as botocore addresses them."""
        quoted = quote(key, safe="/~")
        if self._endpoint:
            u = urlsplit(self._endpoint)
            base = u.path.rstrip("/")
            if self._style == "virtual":
                return f"{u.scheme}://{bucket}.{u.netloc}{base}/{quoted}"
            return f"{u.scheme}://{u.netloc}{base}/{bucket}/{quoted}"
        host = f"s3.{region}.amazonaws.com"
        if self._style != "path" and _VIRTUAL_HOSTABLE.fullmatch(bucket):
            return f"https://{bucket}.{host}/{quoted}"
        return f"https://{host}/{bucket}/{quoted}"

    def _url(self, path: str) -> tuple[str, str]:
        """A presigned URL for GETs of `path`, and the region it is signed for."""
        now = time.monotonic()
        bucket, _, key = path.partition("/")
        region = self._region(bucket)
        signed = self._signed.get(path)
        if signed is not None and now - signed[0] <= PRESIGN_TTL_S and signed[1] == region:
            return signed[2], region
        url = self._object_url(bucket, key, region)
        if not self._anon:
            from botocore.auth import S3SigV4QueryAuth
            from botocore.awsrequest import AWSRequest

            request = AWSRequest(method="GET", url=url)
            S3SigV4QueryAuth(self._credentials(), "s3", region, expires=int(PRESIGN_TTL_S * 12)).add_auth(request)
            url = request.url
        with self._lock:
            if len(self._signed) >= _SIGNED_KEPT:
                self._signed = {p: s for p, s in self._signed.items() if now - s[0] <= PRESIGN_TTL_S}
            self._signed[path] = (now, region, url)
        return url, region

    def _connection(self, scheme: str, netloc: str, fresh: bool) -> http.client.HTTPConnection:
        if getattr(self._local, "pid", None) != os.getpid():  # a forked worker: not its parent's sockets
            self._local.pid, self._local.pool = os.getpid(), _Pool()
        pool: _Pool = self._local.pool
        conn = pool.get((scheme, netloc))
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = pool[(scheme, netloc)] = _connect(scheme, netloc, self._timeout_s)
        return conn

    def _answer(
        self, path: str, headers: dict[str, str], own: bool = False
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send a GET of `path` and read its status; an answer that names another region for
        the bucket (S3's 301 or 400) is asked again there, signed for it; the whole object
        (200) for a range that starts past its first byte is refused. `own`: on a new
        connection, not one of this thread's kept ones (a body read over many calls)."""
        for _ in range(2):
            url, signed_for = self._url(path)
            u = urlsplit(url)
            target = f"{u.path}?{u.query}" if u.query else u.path
            for fresh in (False, True):  # a kept connection the server has closed meanwhile: once more, anew
                conn = (
                    _connect(u.scheme, u.netloc, self._timeout_s)
                    if own
                    else self._connection(u.scheme, u.netloc, fresh)
                )
                try:
                    conn.request("GET", target, headers=headers)
                    resp = conn.getresponse()
                    break
                except BaseException as e:
                    conn.close()  # reopened by its next request
                    if fresh or not isinstance(e, (ConnectionError, http.client.HTTPException)):
                        raise
            if resp.status == 200 and not headers["Range"].startswith("bytes=0-"):
                _close(conn, resp)  # the whole object, not the range: its first bytes would come twice
                raise HTTPStatusError(400, f"the server ignored the range {headers['Range']}")
            if resp.status in (200, 206):
                return conn, resp
            said = _said(resp.read(_ERROR_BODY))
            _close(conn, resp)
            region = resp.getheader("x-amz-bucket-region")
            if resp.status in (301, 307, 400) and region and region != signed_for:
                with self._lock:
                    self._regions[path.partition("/")[0]] = region  # what _url signs for from now on
                continue
            raise HTTPStatusError(resp.status, said)
        raise HTTPStatusError(resp.status, said)

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
            _close(conn, resp)
            raise
        if resp.will_close or not resp.isclosed():  # closed by the server, or bytes past the range left unread
            _close(conn, resp)
        total = (
            (resp.getheader("Content-Range") or "").rpartition("/")[2]
            if resp.status == 206
            else resp.getheader("Content-Length") or ""
        )
        return int(total) if total.isdigit() else None

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
            _close(*self._answered)
            self._answered = None


class _Pool(dict[tuple[str, str], http.client.HTTPConnection]):
    """A thread's kept connections, by (scheme, host), closed when the thread ends (its
    thread-local data goes): a store that keeps connections open (SeaweedFS, AWS) would
    otherwise leave their sockets to the garbage collector."""

    def __del__(self) -> None:
        for conn in self.values():
            conn.close()


def _close(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
    """Close a connection and its answer: an answer that ends the connection (HTTP/1.0,
    `Connection: close`) holds the socket itself, which the connection's close leaves open."""
    resp.close()
    conn.close()


def _connect(scheme: str, netloc: str, timeout_s: float) -> http.client.HTTPConnection:
    """A connection to S3, its TLS verified as botocore's is: against AWS_CA_BUNDLE where set,
    else certifi's certificates (botocore's own copy of them without certifi)."""
    if scheme != "https":
        return http.client.HTTPConnection(netloc, timeout=timeout_s)
    return http.client.HTTPSConnection(netloc, timeout=timeout_s, context=_tls(os.environ.get("AWS_CA_BUNDLE")))


@functools.cache
def _tls(ca_bundle: str | None) -> ssl.SSLContext:
    if ca_bundle is None:
        try:
            from certifi import where
        except ImportError:
            import botocore

            ca_bundle = os.path.join(os.path.dirname(botocore.__file__), "cacert.pem")
        else:
            ca_bundle = where()
    return ssl.create_default_context(cafile=ca_bundle)


def _said(body: bytes) -> str:
    """An S3 error answer in a line: its Code and Message."""
    text = body.decode("utf-8", "replace")
    found = {k: re.search(rf"<{k}>(.*?)</{k}>", text, re.S) for k in ("Code", "Message")}
    if found["Code"]:
        return ": ".join(m.group(1).strip() for m in found.values() if m)
    return text.strip()
