"""fsspec clients: the only place that imports fsspec. One instance per process, protocol
and options, with timeouts set and install hints for missing backends."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
from typing import Any

from ..errors import BadRequestError, ShardkitError, hide, one_line, redact, redacted
from .urls import GCS, HTTP, S3, WEBHDFS, StorageOptions, display, netloc, scheme


_INSTALL_HINTS = {
    "s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs",
}


_FILESYSTEMS: dict[tuple[Any, ...], Any] = {}  # this process's filesystem instances


_ONE_ATTEMPT = {"retries": {"total_max_attempts": 1}}  # botocore's config: no retries of its own
REQUEST_TIMEOUT_S = 60  # a connection silent this long fails (and the read is retried)


@functools.cache
def _timeout_adapter() -> Any:
    """A requests transport adapter that gives every request `REQUEST_TIMEOUT_S` unless it
    has a timeout of its own (requests has no default: a stalled connection blocks forever)."""
    import requests.adapters

    class TimeoutAdapter(requests.adapters.HTTPAdapter):
        def send(self, request: Any, stream: bool = False, timeout: Any = None, verify: Any = True, cert: Any = None,
                 proxies: Any = None) -> Any:
            return super().send(request, stream=stream, timeout=timeout or REQUEST_TIMEOUT_S, verify=verify,
                                cert=cert, proxies=proxies)

    return TimeoutAdapter


def _socket_timeout() -> Any:
    """An aiohttp deadline per socket operation, as requests has: a connection silent for
    REQUEST_TIMEOUT_S fails (and is retried); a slow download that keeps moving is not cut off."""
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=REQUEST_TIMEOUT_S)


@functools.cache
def _quiet_gcsfs() -> None:
    """gcsfs logs a request it gave up on with its traceback: a handler of its own keeps
    Python's last-resort one from printing it on stderr, over shardkit's one-line error
    (an application that set logging up still gets the records)."""
    logging.getLogger("gcsfs").addHandler(logging.NullHandler())


def _harden(fs: Any, protocol: str) -> None:
    """Give a requests-based filesystem (WebHDFS) a deadline per request, and have a
    datanode's error raise: fsspec checks the namenode's answers, but takes a datanode's
    error page for the file's bytes (an index that reads as JSON garbage, a shard whose
    sha256 "changed")."""
    try:
        import requests
    except ImportError:  # then no filesystem in use is built on it
        return
    session = getattr(fs, "session", None)
    if not isinstance(session, requests.Session) or getattr(session, "_shardkit", False):
        return  # fsspec hands out one instance for the same options: harden it once
    session._shardkit = True  # type: ignore[attr-defined]  # a mark of our own on the client's session
    for prefix in ("http://", "https://"):
        session.mount(prefix, _timeout_adapter()())
    if protocol in WEBHDFS:
        session.hooks["response"].append(functools.partial(_datanode_errors, netloc(fs._apply_proxy(fs.url))))


def _datanode_errors(namenode: tuple[str | None, int | None], response: Any, *args: Any, **kwargs: Any) -> None:
    """A datanode's error answer raises (fsspec reads its body as the file's bytes). 404 is a
    missing file; anything else is tried again: HDFS's datanodes answer every IOException
    with 403 (a bad replica, an expired block token), and a new OPEN may get another one."""
    if response.status_code < 400 or netloc(response.url) == namenode:
        return
    if response.status_code == 404:
        response.raise_for_status()
    raise ConnectionError(f"the datanode answered {response.status_code} {response.reason}: "
                          f"{one_line(response.text[:300])}")


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
        raise ShardkitError(f"{display(url)}: cannot resolve {host} ({e.strerror}): no network, or a wrong "
                            "endpoint") from redacted(e)
    _RESOLVED.add((host, port))


@functools.cache
def _aio_session() -> Any:
    """One botocore session for every S3 client of this process and the processes it forks:
    a new client made from it skips loading S3's service model and endpoint rules, which
    makes a DataLoader worker's first request ~0.3 s sooner (0.6 s -> 0.25-0.3 s measured).
    It holds no connection: each client opens its own."""
    import aiobotocore.session

    return aiobotocore.session.AioSession()


def filesystem(url: str, storage_options: StorageOptions | None = None,
               instances: dict[tuple[Any, ...], Any] | None = None, client_retries: bool = True) -> tuple[Any, str]:
    """(fsspec filesystem, path within it), one instance per process, protocol, host and
    options, kept in `instances` (this module's by default). Missing backends get an
    install hint. Without `client_retries` the caller retries (`retrying`) and S3's own
    retries are off (botocore's unless the options configure them, and s3fs's), so a
    failing request takes `RETRIES` attempts, not RETRIES x s3fs x botocore."""
    import fsspec
    import fsspec.core

    protocol = scheme(url)
    hide(storage_options)  # its credentials, out of every message of this process
    try:
        if "::" in url:  # chained URLs (simplecache::s3://...): let fsspec assemble them
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
            return fs, str(path)
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        extra = _INSTALL_HINTS.get(protocol)
        hint = f"pip install 'shardkit[{extra}]'" if extra else f"install the fsspec backend for {protocol}://"
        raise ShardkitError(f"{display(url)}: {protocol}:// support is not installed ({hint})") from redacted(e)
    except ValueError as e:  # fsspec: "Protocol not known"
        raise ShardkitError(f"{display(url)}: unknown storage protocol {protocol}://") from redacted(e)
    # "client" is shardkit's choice of S3 client (stores/choice.py), for no fsspec backend
    kwargs = {**cls._get_kwargs_from_urls(url), **{k: v for k, v in (storage_options or {}).items() if k != "client"}}
    if protocol in GCS:
        _quiet_gcsfs()
        if "requests_timeout" not in kwargs:  # gcsfs waits forever on a stalled connection
            kwargs["requests_timeout"] = _socket_timeout()
    client = kwargs.get("client_kwargs") or {}  # None: fsspec's default
    if protocol in HTTP and "timeout" not in client:
        # aiohttp's default: 300 s a request, so a black hole takes 5 x 300 s to fail, and a
        # slow download is cut off at 300 s
        kwargs["client_kwargs"] = {**client, "timeout": _socket_timeout()}
    ours = protocol in S3 and not client_retries
    if ours:  # an instance of its own (fs.retries is set below), never fsspec's shared one, made once a process
        kwargs["config_kwargs"] = {**_ONE_ATTEMPT, **(kwargs.get("config_kwargs") or {})}
        kwargs["skip_instance_cache"] = True
    key = (os.getpid(), protocol, ours, json.dumps(kwargs, sort_keys=True, default=repr))
    cache = _FILESYSTEMS if instances is None or ours else instances
    fs = cache.get(key)
    if fs is None:
        if protocol in S3 and not {"session", "profile"} & kwargs.keys():
            kwargs["session"] = _aio_session()
        fs = _made(cls, kwargs, url, protocol)
        _harden(fs, protocol)
        if protocol in GCS:
            _resolve_once(url, fs)
        if ours:
            fs.retries = 1  # a class attribute of s3fs, not an option
        fs = cache.setdefault(key, fs)
    return fs, cls._strip_protocol(url)


def _made(cls: Any, kwargs: dict[str, Any], url: str, protocol: str) -> Any:
    """A new client, or one line naming the URL (its cause redacted: a client refusing its
    credentials may quote them)."""
    try:
        return cls(**kwargs)
    except ImportError as e:  # hdfs://: pyarrow is imported when the client is made
        hint = "; it needs `pip install pyarrow` and Hadoop's libhdfs" if protocol == "hdfs" else ""
        failure: ShardkitError = ShardkitError(f"{display(url)}: {protocol}:// support is not installed "
                                               f"({one_line(e)}{hint})")
        cause = redacted(e)
    except (TypeError, ValueError) as e:
        failure = BadRequestError(f"{display(url)}: storage options refused by {protocol}://: {redact(one_line(e))}")
        cause = redacted(e)
    except Exception as e:  # noqa: BLE001 - a client that checks its credentials as it is made (gcsfs)
        failure = ShardkitError(f"{display(url)}: cannot set up {protocol}://: {type(e).__name__}: "
                                f"{redact(one_line(e))}")
        cause = redacted(e)
    raise failure from cause  # out of the except blocks: the client's own error is no __context__ either


def endpoint(storage_options: StorageOptions | None) -> str:
    """Where the options point S3 or GCS ('' for the default): one URL on two endpoints
    names two objects."""
    opts = storage_options or {}
    return str(opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url") or "")
