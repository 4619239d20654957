"""Whether presigned GETs (s3_http.py) may read an S3 URL with these storage options and this
environment, and where they go: only where a presigned GET of ours goes where s3fs's client
would and carries all it would; anything else reads through s3fs."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from typing import Any, NamedTuple
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

from .clients import endpoint, env_endpoint
from .patience import OPTIONS
from .s3_signer import given_credentials
from .urls import S3, scheme

# What a presigned GET of ours carries, or what concerns no read; anything else reads through s3fs
_OPTIONS = {
    "key",
    "secret",
    "token",
    "profile",
    "anon",
    "endpoint_url",
    "client_kwargs",
    "config_kwargs",
    "skip_instance_cache",
    "use_listings_cache",
    "listings_expiry_time",
    "max_paths",
    "default_block_size",
    "default_fill_cache",
    "default_cache_type",
    "max_concurrency",
    *OPTIONS,
}
_CLIENT_OPTIONS = {"endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
_CONFIG_OPTIONS = {
    "s3",
    "signature_version",
    "region_name",
    "retries",
    "connect_timeout",
    "read_timeout",
    "max_pool_connections",
    "request_checksum_calculation",
    "response_checksum_validation",
}
# keys of an AWS config profile that choose credentials or concern no request: any other
# (endpoint_url, services, use_fips_endpoint, s3, ca_bundle...) is botocore's to apply, through s3fs
_PROFILE_KEYS = {
    "region",
    "output",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "aws_security_token",
    "role_arn",
    "source_profile",
    "credential_source",
    "role_session_name",
    "external_id",
    "mfa_serial",
    "duration_seconds",
    "web_identity_token_file",
    "credential_process",
    "sso_session",
    "sso_account_id",
    "sso_role_name",
    "sso_region",
    "sso_start_url",
    "sso_registration_scopes",
    "retry_mode",
    "max_attempts",
    "metadata_service_timeout",
    "metadata_service_num_attempts",
    "parameter_validation",
    "tcp_keepalive",
}
_OTHER_PARTITIONS = ("cn-", "us-iso", "eu-iso", "eusc-")  # AWS regions outside *.amazonaws.com
_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")  # botocore's check of a bucket's name


class Target(NamedTuple):
    """Where presigned GETs go: the options' endpoint ('' for AWS's), the region to sign for,
    and botocore's session where a profile or config file is there (else None)."""

    endpoint_url: str
    region: str
    session: Any


def presignable(url: str) -> bool:
    """Whether `url` is an object of an S3 bucket named plainly: an access point's ARN, a
    directory bucket (S3 Express), a name botocore refuses, or a bucket alone is left to s3fs."""
    bucket, _, key = url.partition("://")[2].partition("/")
    return (
        scheme(url) in S3
        and "::" not in url
        and bool(key)
        and bool(_BUCKET.fullmatch(bucket))
        and not bucket.endswith("--x-s3")
    )


def resolve(opts: dict[str, Any]) -> Target | str:
    """Where presigned GETs go, where a GET of ours goes where s3fs's client would and carries
    all it would: credentials, a profile or none (anon), an endpoint, a region, path or virtual
    addressing. Else why not, for what only botocore's client applies: an option this module
    does not know, a TLS setting of the client's own (verify), request payer, FIPS, dual-stack
    or accelerated endpoints, a partition outside amazonaws.com, an endpoint or S3 setting in
    the AWS config profile, fsspec's own S3 configuration, a proxy for the store's host."""
    client, config = opts.get("client_kwargs") or {}, opts.get("config_kwargs") or {}
    if not _botocore():
        return "botocore is not installed"
    unknown = sorted(
        {
            *(opts.keys() - _OPTIONS),
            *(f"client_kwargs.{k}" for k in client.keys() - _CLIENT_OPTIONS),
            *(f"config_kwargs.{k}" for k in config.keys() - _CONFIG_OPTIONS),
            *(f"config_kwargs.s3.{k}" for k in set(config.get("s3") or {}) - {"addressing_style"}),
        }
    )
    if config.get("signature_version") not in (None, "s3v4"):
        unknown.append("config_kwargs.signature_version")
    if unknown:
        return f"the options set {', '.join(unknown)}, which botocore's client applies"
    key, secret, _ = given_credentials(opts)
    env = os.environ
    if bool(key) != bool(secret):
        return "the options give a key without a secret, or a secret without a key"
    for variable in ("AWS_USE_FIPS_ENDPOINT", "AWS_USE_DUALSTACK_ENDPOINT"):
        if env.get(variable, "").lower() == "true":
            return f"{variable} is set"
    if _fsspec_configures_s3():
        return "fsspec's configuration may give s3fs options (FSSPEC_S3* variables or files in its config folder)"
    url = endpoint(opts) or env_endpoint()
    region = client.get("region_name") or config.get("region_name") or env.get("AWS_DEFAULT_REGION")
    session = None
    if (
        opts.get("profile")
        or env.get("AWS_PROFILE")
        or os.path.exists(os.path.expanduser(env.get("AWS_CONFIG_FILE", "~/.aws/config")))
    ):
        import botocore.exceptions
        import botocore.session

        session = botocore.session.Session(profile=opts.get("profile"))
        try:
            profile = session.get_scoped_config()
        except botocore.exceptions.BotoCoreError:  # a profile that is not there: s3fs names it
            return "the AWS profile named is not there"
        if profile.keys() - _PROFILE_KEYS:
            return f"the AWS config profile sets {', '.join(sorted(profile.keys() - _PROFILE_KEYS))}"
        region = region or profile.get("region")
    region = str(region or "us-east-1")
    target = urlsplit(url or f"https://bucket.s3.{region}.amazonaws.com")
    if target.scheme not in ("http", "https") or not target.hostname:
        return f"the endpoint {url!r} is not an http(s) URL"  # botocore's "Invalid endpoint"
    if not url and region.startswith(_OTHER_PARTITIONS):
        return f"region {region} is outside amazonaws.com"
    if getproxies().get(target.scheme) and not proxy_bypass(target.hostname):
        return f"a proxy is set for {target.scheme}://{target.hostname}"
    return Target(url, region, session)


def unapplied(opts: dict[str, Any]) -> str:
    """What of these options, or of this environment, keeps presigned GETs out (for a message)."""
    client, config = opts.get("client_kwargs") or {}, opts.get("config_kwargs") or {}
    keys = (
        sorted(opts.keys() - _OPTIONS)
        + sorted(f"client_kwargs.{k}" for k in client.keys() - _CLIENT_OPTIONS)
        + sorted(f"config_kwargs.{k}" for k in config.keys() - _CONFIG_OPTIONS)
    )
    if keys:
        return f"the storage option(s) {', '.join(keys)}"
    return (
        "these storage options or this environment (a setting only botocore's client applies: a profile's "
        "endpoint or S3 settings, FIPS or dual-stack endpoints, fsspec's S3 configuration, a proxy)"
    )


def _fsspec_configures_s3() -> bool:
    """Whether fsspec's configuration (FSSPEC_S3* variables, files in its config folder) may
    give s3fs options of its own, which reads through s3fs would apply."""
    folder = os.environ.get("FSSPEC_CONFIG_DIR") or os.path.expanduser("~/.config/fsspec")
    return any(k.upper().startswith("FSSPEC_S3") for k in os.environ) or (
        os.path.isdir(folder) and any(name.endswith((".json", ".ini")) for name in os.listdir(folder))
    )


@functools.cache
def _botocore() -> bool:
    """Whether the signer is installed (with shardkit[s3]; else s3fs's path names the extra)."""
    return importlib.util.find_spec("botocore") is not None
