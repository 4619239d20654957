"""S3 ranged reads through obstore (Rust's object_store), `storage_options={"client": "obstore"}`.

Only `get`, a shard's ranged reads in a pass, goes through obstore; the index, listings and
writes stay with presigned GETs and s3fs (PresignedS3Store). The options are read as the
presigned path reads them (s3_http.Direct: credentials through the same chain, the same
endpoint, region and addressing), so both clients reach the same object the same way.

Fork: obstore's runtime does not survive one (forks.py): a process forked from one that has
read through obstore fails at its first read with a line that says so, rather than hanging.
"""

from __future__ import annotations

import datetime
import os
import re
import threading
from typing import TYPE_CHECKING, Any

from .. import s3_http
from .base import Sink
from .forks import starting
from .s3 import PresignedS3Store, _etag

if TYPE_CHECKING:
    from obstore import GetOptions
    from obstore.store import ClientConfig

_TIMEOUT = "kind: Timeout"  # how object_store's error says its client's timeout passed
CHUNK = 256 << 10  # obstore hands the body over in chunks of at least this (its default, 10 MB, holds a sample back)
CREDENTIALS_TTL = datetime.timedelta(minutes=5)  # asked of the presigned path's chain again after this
_STATUS = re.compile(r"status code: (\d{3})")
_BY_KIND = {
    "PreconditionError": 412,
    "NotFoundError": 404,
    "PermissionDeniedError": 403,
    "UnauthenticatedError": 401,
    "NotModifiedError": 304,
}

# (pid, the options' Direct, bucket) -> obstore's S3Store: a Direct is one a process and set of
# options (s3_http.direct keeps it), so two datasets' credentials never share a store
_stores: dict[tuple[int, int, str], Any] = {}
_lock = threading.Lock()


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class ObstoreS3Store(PresignedS3Store):
    name = "s3 (obstore)"

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        """GET bytes [start, stop) through obstore, If-Match the pinned ETag, each chunk handed
        to `sink` as it comes; the object's size. Errors that carry an HTTP status raise as
        s3_http.HTTPStatusError (416: the object ends before `start`)."""
        import obstore

        bucket, _, key = s3_http.path_of(url).partition("/")
        options: GetOptions = {"range": (start, stop)}
        if etag := _etag(pin):
            options["if_match"] = etag
        try:
            result = obstore.get(self._client(url, bucket), key, options=options)
            for chunk in result.stream(min_chunk_size=CHUNK):
                sink.write(chunk)
            return int(result.meta["size"])
        except obstore.exceptions.BaseError as e:
            status = _status(e)
            if status is None and _TIMEOUT in str(e):  # a silent connection: one of the options' stalls (retry.py)
                raise TimeoutError(_said(e)) from None
            if status is None:
                raise  # no answer (a reset): the caller tries again, from where the bytes stopped
            raise s3_http.HTTPStatusError(status, _said(e)) from None

    def _client(self, url: str, bucket: str) -> Any:
        """This process's obstore store for the bucket, made at its first read."""
        pid = os.getpid()
        direct = self.direct
        endpoint, virtual = self.endpoint_for(bucket)
        key = (pid, id(direct), bucket)
        found = _stores.get(key)
        if found is not None:
            return found
        from obstore.store import S3Store

        silence = f"{direct._timeout_s:g}s"  # the options' patience (patience.py), as the presigned path's
        client: ClientConfig = {
            "allow_http": endpoint.startswith("http://"),
            "timeout": "24h",
            "connect_timeout": silence,
            "read_timeout": silence,
        }
        if bundle := os.environ.get("AWS_CA_BUNDLE"):  # botocore's setting, read as the presigned path reads it
            with open(bundle) as f:
                client["root_certificate"] = f.read()
        auth: dict[str, Any] = (
            {"skip_signature": True} if direct._anon else {"credential_provider": lambda: _credentials(direct)}
        )
        store = S3Store(
            bucket,
            endpoint=endpoint,
            region=direct._region(bucket),
            virtual_hosted_style_request=virtual,
            client_options=client,
            retry_config={"max_retries": 0},
            **auth,
        )  # the caller retries
        starting("obstore", url)
        with _lock:
            return _stores.setdefault(key, store)


def _credentials(direct: s3_http.Direct) -> dict[str, Any]:
    """The presigned path's credentials (the options', AWS_* variables, botocore's chain), in
    obstore's shape, asked again after CREDENTIALS_TTL (botocore refreshes its own)."""
    found = direct._credentials()
    return {
        "access_key_id": found.access_key,
        "secret_access_key": found.secret_key,
        "token": found.token,
        "expires_at": datetime.datetime.now(datetime.timezone.utc) + CREDENTIALS_TTL,
    }


def _status(e: BaseException) -> int | None:
    """The HTTP status of an obstore error: its kind, else the status its message quotes."""
    found = _STATUS.search(str(e))
    return _BY_KIND.get(type(e).__name__) or (int(found.group(1)) if found else None)


def _said(e: BaseException) -> str:
    """An obstore error in a line: S3's Code and Message where the answer had them."""
    text = str(e).split("\n\nDebug source:")[0]
    code, message = (re.search(rf"<{k}>(.*?)</{k}>", text, re.S) for k in ("Code", "Message"))
    if code:
        return f"{code.group(1)}: {message.group(1) if message else ''}".rstrip(": ")
    return text.splitlines()[0] if text else type(e).__name__
