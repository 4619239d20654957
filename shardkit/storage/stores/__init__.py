"""Stores by scheme: `store_for(url, storage_options)` is the one way to the store that
reads a URL (base.py says what a store does).

    local    plain paths and file://           os calls
    s3       s3://, s3a://                     presigned GETs (s3_http.py), else s3fs; or as chosen (choice.py)
    gcs      gs://, gcs://                     gcsfs (fsspec.py), with conditional writes; or as chosen (choice.py)
    azure    az://, abfs://, abfss://          adlfs, reads and conditional writes on its client (azure.py)
    webhdfs  webhdfs://, swebhdfs://           fsspec, a ranged read in one OPEN
    fsspec   everything else, chained URLs     the scheme's fsspec backend
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import hide
from ..patience import patience_for
from ..urls import AZURE, GCS, S3, WEBHDFS, StorageOptions, is_local, scheme
from .azure import AzureStore
from .base import Sink, Store
from .fsspec import FsspecStore, GcsStore, WebHdfsStore
from .local import LocalStore
from .choice import client_of, gcs_store, s3_store

Instances = dict[tuple[Any, ...], Any]
_BY_SCHEME: dict[str, Callable[[str, StorageOptions | None, bool, Instances | None], Store]] = {
    **{s: s3_store for s in S3},
    **{s: gcs_store for s in GCS},
    **{s: lambda url, opts, patient, inst: WebHdfsStore(opts, patient, inst) for s in WEBHDFS},
    **{s: lambda url, opts, patient, inst: AzureStore(opts, patient, inst) for s in AZURE},
}


def store_for(
    url: str,
    storage_options: StorageOptions | None = None,
    *,
    patient: bool = False,
    instances: Instances | None = None,
) -> Store:
    """The store that reads `url`. `patient`: reads ride out an outage of the store (the
    caller reached it already); `instances`: a reader's own clients, else this process's."""
    patience_for(url, storage_options)  # a bad timeout= or attempts= is one line, on every store
    if is_local(url):
        return LocalStore(storage_options, patient)
    hide(storage_options)  # its credentials, out of every message of this process (s3_http's client is not fsspec's)
    client_of(url, storage_options)  # a choice of client no store here can honour fails, naming the URL
    make = _BY_SCHEME.get(scheme(url)) if "::" not in url else None  # chained: fsspec assembles them
    if make is None:
        return FsspecStore(storage_options, patient, instances)
    return make(url, storage_options, patient, instances)


__all__ = ["AzureStore", "FsspecStore", "GcsStore", "LocalStore", "Sink", "Store", "store_for"]
