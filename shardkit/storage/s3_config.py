"""What shardkit decided for an S3 URL and its options, in words: the endpoint, the addressing
style, the region, the checksums and the client that reads (presigned GETs or s3fs, and why).
`shardkit info -v` and `StreamingDataset.stats()["store_config"]` show it, so that a store
answering oddly can be told apart from a setting shardkit chose (docs/guides/remote.md)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from . import s3_http
from .s3_presignable import presignable
from .clients import endpoint, env_endpoint, s3_compatible
from .urls import StorageOptions

_NOT_AWS = "an endpoint not AWS's"


def decisions(url: str, storage_options: StorageOptions | None) -> dict[str, str]:
    """{"endpoint", "addressing", "region", "checksums", "client"}: each a value and, in
    brackets, where it came from."""
    opts: dict[str, Any] = dict(storage_options or {})
    client, config = opts.get("client_kwargs") or {}, opts.get("config_kwargs") or {}
    given, from_env = endpoint(opts), env_endpoint()
    target = given or from_env
    aws = not target or (urlsplit(target).hostname or "").endswith((".amazonaws.com", ".amazonaws.com.cn"))
    decided = s3_http.decided(opts) if presignable(url) else _not_presignable(url)
    region = _region(opts, client, config, decided, aws)
    if given:
        where = _bare(given)
    elif from_env:
        where = f"{_bare(from_env)} (AWS_ENDPOINT_URL{'_S3' if os.environ.get('AWS_ENDPOINT_URL_S3') else ''})"
    else:
        where = f"AWS's (s3.{region.split()[0]}.amazonaws.com)"
    made = s3_compatible(opts)  # what the client is given
    style = (config.get("s3") or {}).get("addressing_style")
    if style:
        addressing = f"{style} (the options')"
    elif not aws:
        addressing = f"path ({_NOT_AWS}: the bucket in the path, not the host name)"
    else:
        addressing = "virtual-hosted where the bucket's name allows, else path (botocore's auto)"
    if "request_checksum_calculation" in config:
        checksums = f"{config['request_checksum_calculation']} (the options')"
    elif made.get("request_checksum_calculation") == "when_required":
        checksums = f"only where S3's API requires them ({_NOT_AWS}: many refuse botocore's CRC32 headers)"
    else:
        checksums = "botocore's default (CRC32 on uploads, since botocore 1.36)"
    if isinstance(decided, s3_http.Direct):
        parts = "presigned" if made.get("request_checksum_calculation") == "when_required" else "through s3fs"
        reader = (
            "presigned GETs on plain HTTP (botocore's signer; listings and writes through s3fs, "
            f"multipart uploads' parts {parts})"
        )
    else:
        reader = f"s3fs ({decided})"
    return {"endpoint": where, "addressing": addressing, "region": region, "checksums": checksums, "client": reader}


def _region(
    opts: dict[str, Any], client: dict[str, Any], config: dict[str, Any], decided: s3_http.Direct | str, aws: bool
) -> str:
    named = client.get("region_name") or config.get("region_name")
    if named:
        return f"{named} (the options')"
    if os.environ.get("AWS_DEFAULT_REGION"):
        return f"{os.environ['AWS_DEFAULT_REGION']} (AWS_DEFAULT_REGION)"
    if isinstance(decided, s3_http.Direct) and decided.region != "us-east-1":
        return f"{decided.region} (the AWS profile's)"
    if aws:
        return "us-east-1 (none given: S3 names a bucket's own region, and reads follow it)"
    return "us-east-1 (none given: set client_kwargs={'region_name': ...} where the store wants another, R2 'auto')"


def _not_presignable(url: str) -> str:
    bucket, _, key = url.partition("://")[2].partition("/")
    if not key:
        return "the URL names a bucket alone"
    if bucket.endswith("--x-s3"):
        return "a directory bucket (S3 Express): botocore's client signs for it"
    return "a bucket name botocore does not sign plainly (an access point's ARN?)"


def _bare(url: str) -> str:
    """The endpoint without credentials, should its URL carry any."""
    u = urlsplit(url)
    return u._replace(netloc=u.netloc.rpartition("@")[2]).geturl()
