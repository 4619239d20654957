"""URLs and local paths: which is which, joining, and a form fit for messages."""

from __future__ import annotations

import functools
from typing import Any

from ..errors import redact


StorageOptions = dict[str, Any]


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


@functools.lru_cache(maxsize=4096)  # readers name their shard in every sample's error context
def display(url: str) -> str:
    """`url` fit for messages: passwords and presigned-URL signatures replaced by '***'."""
    return redact(url)


def join(base: str, *names: str) -> str:
    """Join path parts with '/', for local paths and URLs alike."""
    out = base.rstrip("/") if base not in ("/", "") else base
    for name in names:
        out = f"{out}/{name}" if out and not out.endswith("/") else f"{out}{name}"
    return out


GCS = ("gs", "gcs")
WEBHDFS = ("webhdfs",)
HTTP = ("http", "https")
S3 = ("s3", "s3a")
AZURE = ("az", "abfs", "abfss")  # adlfs: Blob Storage and ADLS Gen2, one client
OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss"}  # no folders: a prefix is all there is


def scheme(url: str) -> str:
    return url.split("://", 1)[0]


def netloc(url: str) -> tuple[str | None, int | None]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname, parts.port
