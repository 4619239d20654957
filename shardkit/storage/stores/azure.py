"""Azure Blob Storage and ADLS Gen2 (az://, abfs://, abfss://): adlfs for listings, details,
removals and uploads, and its azure-storage-blob client, driven directly, for what adlfs
does not offer: a ranged read If-Match the ETag pinned at pack time (adlfs's `cat_file`
sends no condition, so a replaced shard would be read silently), a blob read in order
pinned to its first ETag likewise (`InOrder`, in place of adlfs's file), and conditional writes
(base.py): Put Blob with `If-None-Match: *` (Azure answers 409 BlobAlreadyExists where a
blob is there) or `If-Match` an ETag, Delete Blob `If-Match` (412 ConditionNotMet where it
changed). A store of its own rather than azure-storage-blob alone: adlfs already reads the
usual Azure credentials from the options and the environment (a connection string, an
account key, a SAS, a service principal, else azure-identity's DefaultAzureCredential).

The client's own retries are off (clients._azure_retries_off), so shardkit's apply, with
the read-ahead told of throttling (503 ServerBusy, 429) as on S3. The SDK's errors, whose
messages run over many lines (a request id, a time, the XML body), become one line: the
status, Azure's error code and the first line of its message.

Private adlfs API used here (written against adlfs 2026.8): `fs.service_client` (the
azure-storage-blob BlobServiceClient it made), `fs.loop` and `fs.split_path`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, BinaryIO, TypeVar, cast

from ...errors import AccessDeniedError, redact, redacted
from ..patience import patience_for
from ..urls import display
from .base import Sink
from .fsspec import FsspecStore, RetriedFile

T = TypeVar("T")
_REFUSED = object()  # a conditional request's condition failed
_TIMEOUTS = ("connection_timeout", "read_timeout")
# azure-identity's: no credential it tried gave a token (no status: Azure was never asked)
_NO_CREDENTIALS = {"ClientAuthenticationError", "CredentialUnavailableError"}


class AzureRequestError(OSError):
    """An Azure answer in one line (raised from the SDK's error, which keeps its status)."""


class AzureStore(FsspecStore):
    name = "azure (adlfs)"
    conditional = True
    conditional_writes = True

    def timeouts(self) -> dict[str, Any]:
        """The SDK's transport timeouts for shardkit's own requests: `connection_timeout` and
        `read_timeout` as the options give them (adlfs's names), else shardkit's `timeout`
        (patience.py: seconds of silence), which is not the SDK's server-side `timeout`."""
        silence = patience_for("az://", self.options).timeout_s
        given = {k: v for k, v in (self.options or {}).items() if k in _TIMEOUTS and v is not None}
        return {"connection_timeout": silence, "read_timeout": silence, **given}

    def retried(self, url: str, what: str, fn: Callable[[], T], throttled: Callable[[], None] | None = None) -> T:
        return cast(T, super().retried(url, what, lambda: _plainly(url, fn), throttled))

    def _run(self, url: str, call: Callable[[Any], Awaitable[T]]) -> T:
        """`call(blob client of url)` on adlfs's event loop, its errors in one line."""
        fs, path = self.client(url)
        container, blob, version_id = fs.split_path(path)

        async def run() -> T:
            async with fs.service_client.get_blob_client(container, blob, version_id=version_id) as client:
                return await call(client)

        return _plainly(url, lambda: asyncio.run_coroutine_threadsafe(run(), fs.loop).result())

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        """Bytes [start, stop) in one ranged download If-Match the pinned ETag (else 412),
        handed to `sink` chunk by chunk. A range past the end raises (416)."""
        from azure.core import MatchConditions

        etag = (pin or {}).get("etag")  # a local dataset copied up is pinned by fingerprints instead
        condition = {"etag": etag, "match_condition": MatchConditions.IfNotModified} if etag else {}
        condition.update(self.timeouts())

        async def download(client: Any) -> None:
            stream = await client.download_blob(offset=start, length=stop - start, max_concurrency=1, **condition)
            async for chunk in stream.chunks():
                sink.write(chunk)

        self._run(url, download)
        return None

    def open(self, url: str, what: str = "") -> BinaryIO:
        """The blob read in order, in ranged downloads each If-Match the first one's ETag (a
        blob replaced meanwhile fails rather than mixing two versions); the first is sent as
        it is opened, so a missing or forbidden blob fails there."""
        blob = InOrder(self, url)
        self.retried(url, what, blob.fetch)
        return cast(BinaryIO, RetriedFile(blob, url, self, what))

    def download(self, url: str, start: int, stop: int, etag: str | None) -> tuple[bytes, str | None]:
        """Bytes [start, stop) (fewer where the blob ends, none past its end) and the blob's
        ETag; If-Match `etag` where one is given."""
        condition = {**(_if_match(etag) if etag else {}), **self.timeouts()}

        async def download(client: Any) -> tuple[bytes, str | None]:
            from azure.core.exceptions import HttpResponseError

            try:
                stream = await client.download_blob(offset=start, length=stop - start, max_concurrency=1, **condition)
            except HttpResponseError as e:
                if e.status_code == 416:  # the range starts past the end (an empty blob's every range)
                    return b"", etag
                raise
            return await stream.readall(), str(stream.properties.etag)

        return self._run(url, download)

    def _conditional(self, url: str, call: Callable[[Any], Awaitable[Any]], refused: tuple[str, ...]) -> Any:
        """One conditional request, retried; `_REFUSED` where Azure answered with one of the
        `refused` error codes (the condition failed, or the blob is not there)."""

        def attempt() -> Any:
            try:
                return self._run(url, call)
            except AzureRequestError as e:
                if _code(e.__cause__) in refused:
                    return _REFUSED
                raise

        return self.retried(url, "", attempt)

    def read_versioned(self, url: str) -> tuple[bytes, str] | None:
        async def read(client: Any) -> tuple[bytes, str]:
            stream = await client.download_blob(max_concurrency=1, **self.timeouts())
            return await stream.readall(), str(stream.properties.etag)

        found = self._conditional(url, read, ("BlobNotFound",))
        return None if found is _REFUSED else found

    def put_if_absent(self, url: str, data: bytes) -> str | None:
        return self._upload(url, data, {"overwrite": False})

    def replace_if(self, url: str, data: bytes, version: str) -> str | None:
        return self._upload(url, data, {"overwrite": True, **_if_match(version)})

    def _upload(self, url: str, data: bytes, condition: dict[str, Any]) -> str | None:
        async def upload(client: Any) -> Any:
            return await client.upload_blob(data, **condition, **self.timeouts())

        made = self._conditional(url, upload, ("BlobAlreadyExists", "ConditionNotMet", "BlobNotFound"))
        return None if made is _REFUSED else str(made["etag"])

    def remove_if(self, url: str, version: str) -> bool:
        async def delete(client: Any) -> None:
            await client.delete_blob(**_if_match(version), **self.timeouts())

        return self._conditional(url, delete, ("ConditionNotMet", "BlobNotFound")) is not _REFUSED


class InOrder:
    """A blob read front to back, `BLOCK` bytes a download, the first download's ETag pinned
    on the rest. A read that fails leaves the position where it was: its retry (RetriedFile)
    asks for the same bytes. `fetch` is the next download (`open` sends the first at once)."""

    BLOCK = 8 << 20

    def __init__(self, store: AzureStore, url: str):
        self._store, self._url = store, url
        self._at, self._ended = 0, False
        self._buffer = bytearray()
        self._etag: str | None = None

    def fetch(self) -> None:
        if self._ended:
            return
        try:
            data, etag = self._store.download(self._url, self._at, self._at + self.BLOCK, self._etag)
        except AzureRequestError as e:
            if self._etag is None or getattr(e.__cause__, "status_code", None) != 412:
                raise
            raise AzureRequestError(
                f"412 ConditionNotMet: replaced while it was read (its ETag is no longer {self._etag})"
            ) from e.__cause__
        self._etag = self._etag or etag
        self._at += len(data)
        self._buffer += data
        self._ended = len(data) < self.BLOCK

    def read(self, n: int = -1) -> bytes:
        while (n < 0 or len(self._buffer) < n) and not self._ended:
            self.fetch()
        out = bytes(self._buffer if n < 0 else self._buffer[:n])
        del self._buffer[: len(out)]
        return out

    def close(self) -> None:
        self._buffer.clear()
        self._ended = True


def _if_match(version: str) -> dict[str, Any]:
    from azure.core import MatchConditions

    return {"etag": version, "match_condition": MatchConditions.IfNotModified}


def _plainly(url: str, fn: Callable[[], T]) -> T:
    """`fn()`, an error Azure answered raised again in one line (its cause the SDK's error);
    no credentials at all (DefaultAzureCredential found none) fails at once, saying so."""
    try:
        return fn()
    except Exception as e:
        short = _one_line(e)
        if short is not None:
            raise AzureRequestError(short) from e
        if type(e).__name__ not in _NO_CREDENTIALS:
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        failure = AccessDeniedError(
            f"{display(url)}: no credentials: {redact(first)} (give storage_options a "
            "connection_string, account_key or sas_token, or sign in: az login, a managed "
            "identity, AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET)"
        )
        cause = redacted(e)
    raise failure from cause  # out of the except block: the SDK's own error is no __context__ either


def _code(e: BaseException | None) -> str | None:
    """Azure's error code of an SDK error (BlobNotFound, ConditionNotMet, ServerBusy, ...)."""
    code = getattr(e, "error_code", None)
    return None if code is None else str(getattr(code, "value", code))


def _one_line(e: BaseException) -> str | None:
    """An SDK error answered by Azure, in one line; None for any other error (a connection
    refused or cut: the transport's own error says it)."""
    status = getattr(e, "status_code", None)
    if not isinstance(status, int):
        return None
    message = str(getattr(e, "reason", "") or "")
    text = str(getattr(e, "message", "") or e).strip()
    first = text.splitlines()[0] if text else message
    return f"{status} {_code(e) or message}: {first}".rstrip(": ")
