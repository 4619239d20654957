"""S3 and the stores that speak its API. Two clients, one chosen per URL and options
(choice.py; obstore_s3.py is the other a user may choose):

- `PresignedS3Store`: a GET presigned by botocore's signer alone, read on blocking HTTP
  straight into the caller's buffer (s3_http.py: no s3fs, aiobotocore or event loop in a
  worker, a third of the CPU per MB of s3fs's reads). Used wherever the options and the
  environment leave nothing for botocore's own client to apply (see s3_presignable.resolve);
  a multipart upload's parts PUT presigned the same way where no checksum goes with them.
- `S3fsStore`: s3fs for everything else, and for listings and removals always.

Both make every ranged read conditional on the ETag pinned at pack time (If-Match), so a
replaced shard answers 412, and write small objects conditionally (base.py): PutObject
with `If-None-Match: *` or `If-Match` an ETag, DeleteObject with `If-Match` (S3 and moto
answer 412 to a condition that fails; an S3-compatible store that ignores the header
would write unconditionally). Private s3fs API used here (written against s3fs 2026.9):
`fs._call_s3`, `fs.loop` and `fs.split_path`, to stream a body chunk by chunk (s3fs's
`cat_file` reads a whole body before it returns) with If-Match, and to send those
conditions, which s3fs does not offer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from concurrent.futures import FIRST_COMPLETED, wait
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, cast

from .. import s3_config, s3_http
from ..clients import filesystem, s3_compatible
from ..retry import retrying, root_cause, status_of
from ..urls import StorageOptions, display
from .base import Sink
from .fsspec import FsspecStore, RetriedFile, Upload

CHUNK = 1 << 20  # the most bytes asked of the socket at once (it gives what has come, often less)


def _etag(pin: dict[str, Any] | None) -> str | None:
    return pin.get("etag") if pin is not None else None


class S3fsStore(FsspecStore):
    name = "s3fs"
    conditional = True

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        """GET bytes [start, stop) through s3fs's client, each chunk handed to `sink` as it
        arrives, on s3fs's event loop; If-Match the pinned ETag (else 412). A range past the
        end raises (416)."""
        fs, path = self.client(url)
        bucket, key, version_id = fs.split_path(path)
        extra = {"IfMatch": etag} if (etag := _etag(pin)) else {}
        if version_id:
            extra["VersionId"] = version_id

        async def get() -> None:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}", **extra)
            body = resp["Body"]
            try:
                while chunk := await body.read(CHUNK):
                    sink.write(chunk)
            finally:
                body.close()

        asyncio.run_coroutine_threadsafe(get(), fs.loop).result()
        return None

    def describe(self, url: str) -> dict[str, str]:
        return {"store": self.name, **s3_config.decisions(url, self.options)}

    def remove_dir(self, url: str) -> None:
        """S3 has no folders, but stores built on a file system do: SeaweedFS's filer keeps an
        emptied prefix as a folder, listed as one, until its "folder/" key is deleted. Where
        nothing is under the prefix, that key is deleted (on AWS and moto: a key that is not
        there, which is no error); best effort."""
        fs, path = self.client(url)
        bucket, key, _ = fs.split_path(path.rstrip("/"))
        if not key:
            return
        with contextlib.suppress(Exception):
            listed = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=key + "/", MaxKeys=1)
            if not listed.get("KeyCount") and not listed.get("Contents"):
                fs.call_s3("delete_object", Bucket=bucket, Key=key + "/")
                fs.invalidate_cache(path)

    conditional_writes = True

    def _call(self, url: str, method: str, body: bool = False, **kw: Any) -> Any:
        """One S3 call on the object `url` (with `body`, the whole body read too), retried;
        a failed condition (412) or a missing object (404) is `_REFUSED`, not an error: a
        missing bucket is one."""
        fs, path = self.client(url)
        bucket, key, _ = fs.split_path(path)

        async def call() -> Any:
            try:
                resp = await fs._call_s3(method, Bucket=bucket, Key=key, **kw)
            except OSError as e:  # s3fs's, from botocore's ClientError (its root cause)
                cause = root_cause(e)
                if status_of(cause) in (404, 412) and _code(cause) != "NoSuchBucket":
                    return _REFUSED
                raise
            if body:
                stream = resp["Body"]
                try:
                    resp["Body"] = await stream.read()
                finally:
                    stream.close()
            return resp

        return self.retried(url, "", lambda: asyncio.run_coroutine_threadsafe(call(), fs.loop).result())

    def read_versioned(self, url: str) -> tuple[bytes, str] | None:
        resp = self._call(url, "get_object", body=True)
        return None if resp is _REFUSED else (bytes(resp["Body"]), str(resp["ETag"]))

    def put_if_absent(self, url: str, data: bytes) -> str | None:
        resp = self._call(url, "put_object", Body=data, IfNoneMatch="*")
        return None if resp is _REFUSED else str(resp["ETag"])

    def replace_if(self, url: str, data: bytes, version: str) -> str | None:
        resp = self._call(url, "put_object", Body=data, IfMatch=version)
        return None if resp is _REFUSED else str(resp["ETag"])

    def remove_if(self, url: str, version: str) -> bool:
        return self._call(url, "delete_object", IfMatch=version) is not _REFUSED

    @contextlib.contextmanager
    def writer(self, url: str) -> Iterator[BinaryIO]:
        """A multipart upload whose parts go up several at once (a capped connection is not
        the limit), completed at the end, aborted on error."""
        fs, path = filesystem(url, self.options)  # the client's own retries on: only it can retry a part
        what = display(url)
        upload = MultipartUpload(fs, path, put_part=self.part_putter(url))
        try:
            yield cast(BinaryIO, Upload(upload, what))
            retrying(what, upload.close, 1)
        except BaseException:
            upload.abort()
            raise

    def part_putter(self, url: str) -> PutPart | None:
        """How a multipart upload of `url` sends its parts, where not through s3fs's client."""
        return None


def _code(e: BaseException) -> str | None:
    """The S3 error code botocore's error carries (NoSuchKey, NoSuchBucket, ...)."""
    response = getattr(e, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


_REFUSED = object()  # a conditional request's condition failed


class PresignedS3Store(S3fsStore):
    name = "s3 (presigned)"

    def __init__(
        self,
        direct: s3_http.Direct,
        storage_options: StorageOptions | None = None,
        patient: bool = False,
        instances: dict[tuple[Any, ...], Any] | None = None,
    ):
        super().__init__(storage_options, patient, instances)
        self.direct = direct

    def endpoint_for(self, bucket: str) -> tuple[str, bool]:
        """(the endpoint the bucket's GETs go to, whether it is virtual-hosted: the bucket in
        its host name), as s3_http.Direct addresses them: for the other clients of S3."""
        url = self.direct._object_url(bucket, "k", self.direct._region(bucket))
        base = url[: -len("/k")]
        virtual = not base.endswith(f"/{bucket}")
        return (base if virtual else base[: -len(f"/{bucket}")]), virtual

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        return self.direct.get(s3_http.path_of(url), start, stop, sink.receive, _etag(pin))

    def cat(self, url: str) -> bytes:
        return cast(bytes, self.retried(url, "", lambda: self.direct.cat(s3_http.path_of(url))))

    def open(self, url: str, what: str = "") -> BinaryIO:
        body = self.retried(url, what, lambda: self.direct.open(s3_http.path_of(url)))
        return cast(BinaryIO, RetriedFile(body, url, self, what))

    def part_putter(self, url: str) -> PutPart | None:
        """Parts PUT presigned, straight from their buffers (s3_http.Direct.put_part), retried
        here: where botocore's client would send no checksum with them either (an endpoint
        not AWS's, or the options' `request_checksum_calculation="when_required"`); on AWS
        botocore's CRC32 of each part is kept, through s3fs."""
        if s3_compatible(self.options or {}).get("request_checksum_calculation") != "when_required":
            return None
        path = s3_http.path_of(url)

        def put(upload_id: str, number: int, body: memoryview) -> str:
            return cast(
                str, self.retried(url, f" (part {number})", lambda: self.direct.put_part(path, upload_id, number, body))
            )

        return put


PART = 8 << 20  # a multipart upload's part (S3 wants 5 MiB at least, but for the last)
UPLOADS = 8  # parts of one upload in flight at once: a capped connection's rate, eight times...
PARTS_IN_FLIGHT = 64  # ...and of all the uploads of a pack's processes together (512 MB; 2 a process at least)
_uploads = UPLOADS


def share_uploads(processes: int) -> None:
    """This process is one of `processes` uploading at once (a pack's pool): each of its
    uploads keeps `PARTS_IN_FLIGHT / processes` parts in flight (2 at least, `UPLOADS` at
    most), so that more processes take more connections, not more memory."""
    global _uploads
    _uploads = max(2, min(UPLOADS, PARTS_IN_FLIGHT // max(1, processes)))


PutPart = Callable[[str, int, memoryview], str]  # (upload id, part number, its bytes) -> its ETag, retried


class _SpareParts:
    """Part buffers kept for the next parts of this process's uploads: a fresh 8-MB buffer is
    zeroed by the kernel a page fault at a time as it is written (streams.Buffers says what
    that costs); at most a process's parts in flight and one filling are kept, none
    inherited by a forked process."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._lock, self._free = threading.Lock(), list[bytearray]()

    def take(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(PART)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._free) <= _uploads:
                self._free.append(buf)


_SPARE_PARTS = _SpareParts()


class MultipartUpload:
    """An S3 object written as a multipart upload whose parts go up `UPLOADS` at a time
    (fewer in each of a pack's many processes: `share_uploads`) on threads of their own
    (s3fs's file uploads its parts one after the other: one connection, which a store's
    per-connection cap holds to tens of MB/s). The object appears only when `close`
    completes the upload; `abort` throws it away. Memory: at most that many parts in
    flight and one filling, each written into a kept buffer. A file smaller than a part is
    one PUT. Each part, an idempotent request, is retried: by `put_part` where it is given
    (a presigned PUT straight from the part's buffer), else by s3fs's client; the caller's
    errors name the URL.

    Through s3fs's public `call_s3` (its client, its credentials and endpoint)."""

    def __init__(self, fs: Any, path: str, uploads: int | None = None, put_part: PutPart | None = None):
        from concurrent.futures import ThreadPoolExecutor

        self._fs, self._uploads, self._put_part = fs, uploads or _uploads, put_part
        self._bucket, self._key, _ = fs.split_path(path)
        self._part: bytearray | None = None  # the next part's bytes as written
        self._filled = 0
        self._parts: list[Any] = []  # futures of the parts sent (their ETags), in order
        self._upload_id: str | None = None
        self._pool = ThreadPoolExecutor(self._uploads, thread_name_prefix="shardkit-upload")

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")  # bytes, whatever the buffer's items
        n = len(view)
        while view:
            if self._part is None:
                self._part = _SPARE_PARTS.take()
            room = min(PART - self._filled, len(view))
            self._part[self._filled : self._filled + room] = view[:room]  # the caller may reuse its buffer
            self._filled += room
            view = view[room:]
            if self._filled == PART:
                self._send()
        return n

    def _send(self) -> None:
        """The part written so far, sent on a thread of its own (at most `_uploads` at once)."""
        part, size = self._part, self._filled
        assert part is not None
        self._part, self._filled = None, 0
        if self._upload_id is None:
            self._upload_id = self._fs.call_s3("create_multipart_upload", Bucket=self._bucket, Key=self._key)[
                "UploadId"
            ]
        while len(pending := [f for f in self._parts if not f.done()]) >= self._uploads:  # bounded
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                f.result()  # a failed part ends the upload now, not at its close
        upload_id, number, put_part = self._upload_id, len(self._parts) + 1, self._put_part

        def put() -> str:
            try:
                if put_part is not None:
                    return put_part(upload_id, number, memoryview(part)[:size])
                body = bytes(memoryview(part)[:size])
            finally:
                _SPARE_PARTS.give(part)  # sent, or copied for s3fs's client (which may keep it a while)
            return str(
                self._fs.call_s3(
                    "upload_part", Bucket=self._bucket, Key=self._key, UploadId=upload_id, PartNumber=number, Body=body
                )["ETag"]
            )

        self._parts.append(self._pool.submit(put))

    def _rest(self) -> bytes:
        """What is written and not sent (an object smaller than a part)."""
        rest = bytes(memoryview(self._part)[: self._filled]) if self._part is not None else b""
        if self._part is not None:
            _SPARE_PARTS.give(self._part)
        self._part, self._filled = None, 0
        return rest

    def close(self) -> None:
        """Send what is left and complete the upload: the object appears, whole."""
        try:
            if self._upload_id is None:
                self._fs.call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=self._rest())
                return
            if self._filled:
                self._send()
            parts = [{"PartNumber": n, "ETag": f.result()} for n, f in enumerate(self._parts, 1)]
            self._fs.call_s3(
                "complete_multipart_upload",
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._fs.invalidate_cache(f"{self._bucket}/{self._key}")

    def abort(self) -> None:
        """Throw the upload away: nothing appears under its name."""
        for f in self._parts:
            f.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # the error that stopped the upload is the one to report
                self._fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
