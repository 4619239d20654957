"""Which client reads an S3 or GCS dataset's shards: `storage_options={"client": NAME}`.

    s3://  presigned  GETs presigned by botocore's signer, on blocking HTTP (s3_http.py): the default
           obstore    the Rust object_store client (the `obstore` extra, or pip install obstore)
           s3fs       s3fs (aiobotocore) for everything
    gs://  gcsfs      gcsfs for everything: the default
           obstore    obstore's GETs, gcsfs for the rest (obstore_gcs.py)

The choice is shardkit's, not the client's: the key is taken out of the options before they
reach any client, a name not listed here is refused, and so is a choice the options or the
URL cannot honour (no silent fallback); the store that reads says its name in `stats()`.
Listings, writes (with presigned PUTs of a multipart upload's parts, stores/s3.py) and the
main process's reads (the index) stay with presigned GETs and s3fs
(gcsfs on GCS) whatever the choice, so no Rust runtime starts before DataLoader forks its workers.
docs/design.md says why presigned (and gcsfs) is the default and what the others are kept for (measured:
docs/measurements.md; s3torchconnector's CRT client was measured too, and dropped).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from ...errors import BadRequestError, ShardkitError
from .. import s3_http, s3_presignable
from ..patience import CLIENT
from ..urls import GCS, S3, StorageOptions, display, scheme
from .fsspec import GcsStore
from .obstore_gcs import ObstoreGcsStore, unapplied
from .obstore_s3 import ObstoreS3Store
from .s3 import PresignedS3Store, S3fsStore

CLIENTS = ("presigned", "obstore", "s3fs")  # S3's
GCS_CLIENTS = ("gcsfs", "obstore")
_ANY = tuple(dict.fromkeys((*CLIENTS, *GCS_CLIENTS)))


def client_of(url: str, storage_options: StorageOptions | None) -> str | None:
    """The client the options choose for `url` (None: the default); an unknown name, or a
    choice for a URL that is neither S3's nor GCS's, is a BadRequestError naming the URL."""
    chosen = (storage_options or {}).get(CLIENT)
    if chosen is None:
        return None
    known = CLIENTS if scheme(url) in S3 else GCS_CLIENTS if scheme(url) in GCS else _ANY
    if chosen not in known:
        raise BadRequestError(
            f"{display(url)}: unknown storage option client={chosen!r}; choose from {', '.join(known)}"
        )
    if (scheme(url) not in S3 and scheme(url) not in GCS) or "::" in url:
        raise BadRequestError(f"{display(url)}: storage option client={chosen!r} applies to s3:// and gs:// URLs only")
    return str(chosen)


def without_client(storage_options: StorageOptions | None) -> StorageOptions | None:
    """The options as the clients get them: shardkit's `client` key taken out."""
    if not storage_options or CLIENT not in storage_options:
        return storage_options
    return {k: v for k, v in storage_options.items() if k != CLIENT}


def s3_store(
    url: str, storage_options: StorageOptions | None, patient: bool, instances: dict[tuple[Any, ...], Any] | None
) -> S3fsStore:
    """The S3 store that reads `url` with these options (and this environment): the client
    they choose (choice.py), else presigned GETs where they can go, else s3fs."""
    client = client_of(url, storage_options)
    opts = without_client(storage_options)
    if client == "s3fs":
        return S3fsStore(opts, patient, instances)
    direct = s3_http.direct_for(url, opts)
    if client in (None, "presigned") and direct is not None:
        return PresignedS3Store(direct, opts, patient, instances)
    if client is None or not s3_http.path_of(url).partition("/")[2]:  # a bucket alone: listings, s3fs's
        return S3fsStore(opts, patient, instances)
    if direct is None:  # the options or the URL need botocore's own client: only s3fs has it
        cannot = (
            s3_presignable.unapplied(opts or {})
            if s3_presignable.presignable(url)
            else "this bucket (an access point or a directory bucket)"
        )
        raise BadRequestError(
            f"{display(url)}: storage option client={client!r} cannot apply {cannot}; client='s3fs' can"
        )
    if importlib.util.find_spec(_MODULES[client]) is None:
        raise ShardkitError(f"{display(url)}: storage option client={client!r}: {_HINTS[client]}")
    return ObstoreS3Store(direct, opts, patient, instances)


def gcs_store(
    url: str, storage_options: StorageOptions | None, patient: bool, instances: dict[tuple[Any, ...], Any] | None
) -> GcsStore:
    """The GCS store that reads `url`: gcsfs, or obstore's GETs where the options choose it."""
    client = client_of(url, storage_options)
    opts = without_client(storage_options)
    if client != "obstore":
        return GcsStore(opts, patient, instances)
    unapplied(url, opts)
    if importlib.util.find_spec(_MODULES[client]) is None:
        raise ShardkitError(f"{display(url)}: storage option client={client!r}: {_HINTS[client]}")
    return ObstoreGcsStore(opts, patient, instances)


_MODULES = {"obstore": "obstore"}
_HINTS = {"obstore": "obstore is not installed (pip install obstore, or the obstore extra)"}
