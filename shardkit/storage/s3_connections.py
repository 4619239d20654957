"""The connections of S3 GETs on blocking HTTP (`http.client`): kept per thread, by scheme
and host, and reused where the server allows it; a forked worker opens its own; TLS verified
as botocore verifies it."""

from __future__ import annotations

import functools
import http.client
import os
import ssl
import threading


class ThreadConnections:
    """Each thread's kept connections (a forked worker's own, never its parent's sockets), and
    new ones, all with `timeout_s` of silence before a socket operation fails."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._local = threading.local()  # this thread's connections, by (scheme, host), and its process

    def kept(self, scheme: str, netloc: str, fresh: bool) -> http.client.HTTPConnection:
        """This thread's connection to `netloc`; with `fresh`, a new one in place of the kept one."""
        if getattr(self._local, "pid", None) != os.getpid():  # a forked worker: not its parent's sockets
            self._local.pid, self._local.pool = os.getpid(), _Pool()
        pool: _Pool = self._local.pool
        conn = pool.get((scheme, netloc))
        if conn is None or fresh:
            if conn is not None:
                conn.close()
            conn = pool[(scheme, netloc)] = connect(scheme, netloc, self.timeout_s)
        return conn

    def new(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        """A connection of the caller's own, not kept (a body read over many calls)."""
        return connect(scheme, netloc, self.timeout_s)


class _Pool(dict[tuple[str, str], http.client.HTTPConnection]):
    """A thread's kept connections, by (scheme, host), closed when the thread ends (its
    thread-local data goes): a store that keeps connections open (SeaweedFS, AWS) would
    otherwise leave their sockets to the garbage collector."""

    def __del__(self) -> None:
        for conn in self.values():
            conn.close()


def close(conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
    """Close a connection and its answer: an answer that ends the connection (HTTP/1.0,
    `Connection: close`) holds the socket itself, which the connection's close leaves open."""
    resp.close()
    conn.close()


def connect(scheme: str, netloc: str, timeout_s: float) -> http.client.HTTPConnection:
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
