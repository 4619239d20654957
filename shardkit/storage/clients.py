"""fsspec clients: the only place that imports fsspec. One instance per process, protocol
and options, with timeouts set and install hints for missing backends.

Private API of the backends, kept here rather than in their stores (stores/*, which hold
the rest): it is applied as each client is made, to every client `filesystem` hands out,
including those of callers that are no store (atomic.py's uploads, the packer's listings),
and stores/ sits above this module. Written against fsspec 2026.9 (WebHDFS's `session`,
`url` and `_apply_proxy`, for a deadline per request and a datanode's errors: `_harden`),
gcsfs 2026.10 (`fs.base`, its endpoint: `_resolve_once`), s3fs 2026.9 (the `retries` class
attribute) and adlfs 2026.8 with azure-storage-blob 12.31 (`fs.service_client._config`:
`_azure_retries_off`), the last two for `client_retries=False`, which makes a client of
shardkit's own with its retries off. fsspec's own `_get_kwargs_from_urls` and
`_strip_protocol`, which every backend has, are used as fsspec.core uses them."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
from typing import Any
from urllib.parse import urlsplit

from ..errors import BadRequestError, ShardkitError, hide, one_line, redact, redacted
from .patience import client_options, patience_for
from .urls import AZURE, GCS, HTTP, S3, WEBHDFS, StorageOptions, display, netloc, scheme


_INSTALL_HINTS = {  # a package from the registry: shardkit is not on it (a checkout's extras: '.[s3]', '.[gcs]')
    "s3": "pip install s3fs",
    "s3a": "pip install s3fs",
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
}
# where adlfs finds credentials that are not in the options: hidden from messages as the options' are
_AZURE_ENV = {
    "connection_string": "AZURE_STORAGE_CONNECTION_STRING",
    "account_key": "AZURE_STORAGE_ACCOUNT_KEY",
    "sas_token": "AZURE_STORAGE_SAS_TOKEN",
    "client_secret": "AZURE_STORAGE_CLIENT_SECRET",
}


_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}  # this process's filesystem instances


_ONE_ATTEMPT = {"retries": {"total_max_attempts": 1}}  # botocore's config: no retries of its own


def _timeout_adapter(timeout_s: float) -> Any:
    """A requests transport adapter that gives every request `timeout_s` unless it has a
    timeout of its own (requests has no default: a stalled connection blocks forever)."""
    import requests.adapters

    class TimeoutAdapter(requests.adapters.HTTPAdapter):
        def send(
            self,
            request: Any,
            stream: bool = False,
            timeout: Any = None,
            verify: Any = True,
            cert: Any = None,
            proxies: Any = None,
        ) -> Any:
            return super().send(
                request, stream=stream, timeout=timeout or timeout_s, verify=verify, cert=cert, proxies=proxies
            )

    return TimeoutAdapter()


def _socket_timeout(timeout_s: float) -> Any:
    """An aiohttp deadline per socket operation, as requests has: a connection silent for
    `timeout_s` fails (and is retried); a slow download that keeps moving is not cut off."""
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)


@functools.cache
def _quiet_gcsfs() -> None:
    """gcsfs logs a request it gave up on with its traceback: a handler of its own keeps
    Python's last-resort one from printing it on stderr, over shardkit's one-line error
    (an application that set logging up still gets the records)."""
    logging.getLogger("gcsfs").addHandler(logging.NullHandler())


@functools.cache
def _quiet_azure() -> None:
    """azure-identity logs every credential it tried, a dozen lines, as a warning each time
    none gave a token: a handler of its own keeps them off stderr, under shardkit's one-line
    error (an application that set logging up still gets the records)."""
    logging.getLogger("azure").addHandler(logging.NullHandler())


def _harden(fs: Any, protocol: str, timeout_s: float) -> None:
    """Give a requests-based filesystem (WebHDFS) a deadline per request, and have a
    datanode's error raise: fsspec checks the namenode's answers, but takes a datanode's
    error page for the file's bytes (an index that reads as JSON garbage, a shard whose
    sha256 "changed")."""
    try:
        import requests
    except ImportError:  # then no filesystem in use is built on it
        return
    session = getattr(fs, "session", None)
    if not isinstance(session, requests.Session) or getattr(session, "_shardkit", None) == timeout_s:
        return  # fsspec hands out one instance for the same options: harden it once
    hooked = hasattr(session, "_shardkit")
    session._shardkit = timeout_s  # type: ignore[attr-defined]  # a mark of our own on the client's session
    for prefix in ("http://", "https://"):
        session.mount(prefix, _timeout_adapter(timeout_s))
    if protocol in WEBHDFS and not hooked:  # fsspec 2026.9's WebHDFS: its namenode URL, through its proxy
        session.hooks["response"].append(functools.partial(_datanode_errors, netloc(fs._apply_proxy(fs.url))))


def _datanode_errors(namenode: tuple[str | None, int | None], response: Any, *args: Any, **kwargs: Any) -> None:
    """A datanode's error answer raises (fsspec reads its body as the file's bytes). 404 is a
    missing file; anything else is tried again: HDFS's datanodes answer every IOException
    with 403 (a bad replica, an expired block token), and a new OPEN may get another one."""
    if response.status_code < 400 or netloc(response.url) == namenode:
        return
    if response.status_code == 404:
        response.raise_for_status()
    raise ConnectionError(
        f"the datanode answered {response.status_code} {response.reason}: {one_line(response.text[:300])}"
    )


_RESOLVED: set[tuple[str | None, int | None]] = set()  # GCS hosts this process found (forked workers inherit it)


def _resolve_once(url: str, fs: Any) -> None:
    """Look the host of a GCS endpoint up on this process's first contact with it. gcsfs tries
    a request 6 times over ~35 s whatever failed, so a host that does not resolve (no
    network, a typo in endpoint_url) was a minute of silence, where S3 fails in ~2 s. Once it
    has resolved, a DNS error (a blip mid-epoch) gets gcsfs's retries like any other."""
    host, port = netloc(fs.base)
    if (host, port) in _RESOLVED:
        return
    try:
        socket.getaddrinfo(host, port or 443, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ShardkitError(
            f"{display(url)}: cannot resolve {host} ({e.strerror}): no network, or a wrong endpoint"
        ) from redacted(e)
    _RESOLVED.add((host, port))


@functools.cache
def _aio_session() -> Any:
    """One botocore session for every S3 client of this process and the processes it forks:
    a new client made from it skips loading S3's service model and endpoint rules, which
    makes a DataLoader worker's first request ~0.3 s sooner (0.6 s -> 0.25-0.3 s measured).
    It holds no connection: each client opens its own. Its PUTs (an upload's parts, a
    progress record, an index) go without `Expect: 100-continue`, which botocore sends
    with every file-like body: each would wait a round trip for the server's go-ahead
    before its first byte (measured through 50 ms: a small PUT 110 ms -> 55). The
    go-ahead only spares the body of a request the server refuses, which is retried
    whole either way."""
    import aiobotocore.session
    from botocore.handlers import add_expect_header

    session = aiobotocore.session.AioSession()
    session.unregister("before-call.s3", add_expect_header)
    return session


def filesystem(
    url: str,
    storage_options: StorageOptions | None = None,
    instances: dict[tuple[Any, ...], Any] | None = None,
    client_retries: bool = True,
) -> tuple[Any, str]:
    """(fsspec filesystem, path within it), one instance per process, protocol, host and
    options, kept in `instances` (this module's by default). Missing backends get an
    install hint. Without `client_retries` the caller retries (`retrying`) and S3's own
    retries are off (botocore's unless the options configure them, and s3fs's), so a
    failing request takes `RETRIES` attempts, not RETRIES x s3fs x botocore. shardkit's own
    options (patience.py) set the client's timeouts and are not passed on."""
    import fsspec
    import fsspec.core

    protocol = scheme(url)
    hide(storage_options)  # its credentials, out of every message of this process
    timeout_s = patience_for(url, storage_options).timeout_s
    storage_options = client_options(storage_options)
    try:
        if "::" in url:  # chained URLs (simplecache::s3://...): let fsspec assemble them
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
            return fs, str(path)
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        hint = _INSTALL_HINTS.get(protocol) or f"install the fsspec backend for {protocol}://"
        raise ShardkitError(f"{display(url)}: {protocol}:// support is not installed ({hint})") from redacted(e)
    except ValueError as e:  # fsspec: "Protocol not known"
        raise ShardkitError(f"{display(url)}: unknown storage protocol {protocol}://") from redacted(e)
    ours = protocol in S3 + AZURE and not client_retries
    kwargs = _client_kwargs(cls, url, protocol, storage_options, timeout_s, ours)
    key = (os.getpid(), protocol, ours, json.dumps(kwargs, sort_keys=True, default=repr))
    cache = _FILESYSTEMS if instances is None or ours else instances
    fs = cache.get(key)
    if fs is None:
        fs = cache.setdefault(key, _new_filesystem(cls, kwargs, url, protocol, timeout_s, ours))
    return fs, cls._strip_protocol(url)


def _client_kwargs(
    cls: Any, url: str, protocol: str, storage_options: StorageOptions | None, timeout_s: float, ours: bool
) -> dict[str, Any]:
    """The backend's options: the URL's and the caller's, with shardkit's timeouts where the
    caller set none, and (`ours`: shardkit retries) the S3 client's own retries off."""
    kwargs = {**cls._get_kwargs_from_urls(url), **(storage_options or {})}
    if protocol in GCS:
        _quiet_gcsfs()
        if "requests_timeout" not in kwargs:  # gcsfs waits forever on a stalled connection
            kwargs["requests_timeout"] = _socket_timeout(timeout_s)
    client = kwargs.get("client_kwargs") or {}  # None: fsspec's default
    if protocol in HTTP and "timeout" not in client:
        # aiohttp's default: 300 s a request, so a black hole takes 5 x 300 s to fail, and a
        # slow download is cut off at 300 s
        kwargs["client_kwargs"] = {**client, "timeout": _socket_timeout(timeout_s)}
    if protocol in S3:
        kwargs["config_kwargs"] = s3_compatible(kwargs)
    if protocol in AZURE:
        hide({name: os.environ.get(variable) for name, variable in _AZURE_ENV.items()})
        _quiet_azure()
    if protocol in S3:  # botocore's default: 60 s silent before a read fails
        config = kwargs.get("config_kwargs") or {}
        kwargs["config_kwargs"] = {"connect_timeout": timeout_s, "read_timeout": timeout_s, **config}
    if (
        ours
    ):  # an instance of its own (its retries are turned off below), never fsspec's shared one, made once a process
        if protocol in S3:
            kwargs["config_kwargs"] = {**_ONE_ATTEMPT, **(kwargs.get("config_kwargs") or {})}
        kwargs["skip_instance_cache"] = True
    return kwargs


def _new_filesystem(cls: Any, kwargs: dict[str, Any], url: str, protocol: str, timeout_s: float, ours: bool) -> Any:
    """A new filesystem instance, hardened (timeouts, one DNS lookup for GCS) and, where
    shardkit retries (`ours`), with the client's own retries off."""
    if protocol in S3 and not {"session", "profile"} & kwargs.keys():
        kwargs["session"] = _aio_session()  # after the cache key: the session is not an option of the caller's
    fs = _made(cls, kwargs, url, protocol)
    _harden(fs, protocol, timeout_s)
    if protocol in GCS:
        _resolve_once(url, fs)
    if ours and protocol in S3:
        fs.retries = 1  # a class attribute of s3fs (2026.9), not an option
    elif ours:
        _azure_retries_off(fs)
    return fs


def _azure_retries_off(fs: Any) -> None:
    """azure-storage-blob retries a failed request itself, 3 times from 15 s apart
    (ExponentialRetry's defaults, which adlfs gives no option for): a throttled read would
    wait a minute unseen by the read-ahead, and a dead endpoint take 5 x 1 min to fail. Off
    on the client whose requests shardkit retries. Private API, written against
    azure-storage-blob 12.31: the client's `_config.retry_policy`, which every blob client
    made from it shares."""
    fs.service_client._config.retry_policy.total_retries = 0


def _made(cls: Any, kwargs: dict[str, Any], url: str, protocol: str) -> Any:
    """A new client, or one line naming the URL (its cause redacted: a client refusing its
    credentials may quote them)."""
    try:
        return cls(**kwargs)
    except ImportError as e:  # hdfs://: pyarrow is imported when the client is made
        hint = "; it needs `pip install pyarrow` and Hadoop's libhdfs" if protocol == "hdfs" else ""
        failure: ShardkitError = ShardkitError(
            f"{display(url)}: {protocol}:// support is not installed ({one_line(e)}{hint})"
        )
        cause = redacted(e)
    except (TypeError, ValueError) as e:
        failure = BadRequestError(f"{display(url)}: storage options refused by {protocol}://: {redact(one_line(e))}")
        cause = redacted(e)
    except Exception as e:  # noqa: BLE001 - a client that checks its credentials as it is made (gcsfs)
        failure = ShardkitError(
            f"{display(url)}: cannot set up {protocol}://: {type(e).__name__}: {redact(one_line(e))}"
        )
        cause = redacted(e)
    raise failure from cause  # out of the except blocks: the client's own error is no __context__ either


def s3_compatible(storage_options: StorageOptions) -> dict[str, Any]:
    """botocore's config for these S3 options: on an endpoint that is not AWS's (MinIO,
    SeaweedFS, Ceph, R2, Garage...), path-style addressing (botocore would put the bucket in
    the host name, which such a store's DNS rarely resolves) and checksums only where the
    API requires them (botocore 1.36+ adds CRC32 headers and aws-chunked bodies to every
    upload, which many of them refuse), unless the options say otherwise. From
    `endpoint_url` alone (or AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL), as the other stores'
    users expect."""
    config = dict(storage_options.get("config_kwargs") or {})
    url = endpoint(storage_options) or env_endpoint()
    host = (urlsplit(url).hostname or "") if url else ""
    if url and not host.endswith((".amazonaws.com", ".amazonaws.com.cn")):
        config["s3"] = {"addressing_style": "path", **(config.get("s3") or {})}
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
    return config


def origin(url: str, storage_options: StorageOptions | None) -> str:
    """Where a request for `url` goes, as far as its latency goes: the options' endpoint, or
    an HTTP(S) URL's own host (every plain web server is a store of its own)."""
    found = endpoint(storage_options)
    if found or scheme(url) not in HTTP:
        return found
    host, port = netloc(url)
    return f"{scheme(url)}://{host}" + (f":{port}" if port else "")


def endpoint(storage_options: StorageOptions | None) -> str:
    """Where the options point S3 or GCS ('' for the default): one URL on two endpoints
    names two objects."""
    opts = storage_options or {}
    return str(opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url") or "")


def env_endpoint() -> str:
    """The S3 endpoint AWS's variables name ('' for none), as botocore reads them."""
    env = os.environ
    if env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return ""
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
