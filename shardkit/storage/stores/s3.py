"""S3 and the stores that speak its API. Two clients, one chosen per URL and options:

- `PresignedS3Store`: a GET presigned by botocore's signer alone, read on blocking HTTP
  straight into the caller's buffer (s3_http.py: no s3fs, aiobotocore or event loop in a
  worker, a third of the CPU per MB of s3fs's reads). Used wherever the options and the
  environment leave nothing for botocore's own client to apply (see s3_http._resolve).
- `S3fsStore`: s3fs for everything else, and for listings and removals always.

Both make every ranged read conditional on the ETag pinned at pack time (If-Match), so a
replaced shard answers 412. Private s3fs API used here (written against s3fs 2026.9):
`fs._call_s3`, `fs.loop` and `fs.split_path`, to stream a body chunk by chunk (s3fs's
`cat_file` reads a whole body before it returns) with If-Match, which it does not offer.
"""

from __future__ import annotations

import asyncio
from typing import Any, BinaryIO, cast

from .. import s3_http
from ..urls import StorageOptions
from .base import Sink
from .fsspec import FsspecStore, RetriedFile

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


class PresignedS3Store(S3fsStore):
    name = "s3 (presigned)"

    def __init__(self, direct: s3_http.Direct, storage_options: StorageOptions | None = None, patient: bool = False,
                 instances: dict[tuple[Any, ...], Any] | None = None):
        super().__init__(storage_options, patient, instances)
        self.direct = direct

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        return self.direct.get(s3_http.path_of(url), start, stop, sink.receive, _etag(pin))

    def cat(self, url: str) -> bytes:
        return cast(bytes, self.retried(url, "", lambda: self.direct.cat(s3_http.path_of(url))))

    def open(self, url: str, what: str = "") -> BinaryIO:
        body = self.retried(url, what, lambda: self.direct.open(s3_http.path_of(url)))
        return cast(BinaryIO, RetriedFile(body, url, self, what))


def s3_store(url: str, storage_options: StorageOptions | None, patient: bool,
             instances: dict[tuple[Any, ...], Any] | None) -> S3fsStore:
    """The S3 store that reads `url` with these options (and this environment)."""
    direct = s3_http.direct_for(url, storage_options)
    if direct is not None:
        return PresignedS3Store(direct, storage_options, patient, instances)
    return S3fsStore(storage_options, patient, instances)
