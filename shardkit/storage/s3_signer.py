"""Presigned URLs of S3 GETs and of multipart uploads' part PUTs, by botocore's signer alone
(SigV4 query auth, `botocore.auth`): the credentials (the options', then AWS_* variables, then botocore's own chain: profiles,
SSO, instance roles, resolved once a process), the region each bucket is signed for, and
the URL a GET of an object goes to (path or virtual-hosted addressing, as botocore's)."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, NamedTuple
from urllib.parse import quote, urlencode, urlsplit

PRESIGN_TTL_S = 300.0  # a presigned URL is used this long (it is valid for an hour)
_SIGNED_KEPT = 4096  # presigned URLs kept a process (~1 KB each): past this, the stale ones go
_VIRTUAL_HOSTABLE = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")  # no dots: a wildcard certificate covers it


class Credentials(NamedTuple):
    """What botocore's signer reads of a credentials object (botocore.credentials, which has
    one, costs 70 ms to import)."""

    access_key: str
    secret_key: str
    token: str | None


def given_credentials(opts: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """(key, secret, token) as the storage options give them (each None where they do not)."""
    client = opts.get("client_kwargs") or {}
    return (
        opts.get("key") or client.get("aws_access_key_id"),
        opts.get("secret") or client.get("aws_secret_access_key"),
        opts.get("token") or client.get("aws_session_token"),
    )


class Presigner:
    """Presigned GET URLs of the S3 objects named by bucket/key paths, for one set of storage
    options, where to send them (`endpoint_url`, '' for AWS's) and the region to sign for
    until S3 names a bucket's own."""

    def __init__(self, storage_options: dict[str, Any], endpoint_url: str, region: str, session: Any):
        opts = storage_options
        self._given = given_credentials(opts)
        self._anon = bool(opts.get("anon"))
        self._profile = opts.get("profile")
        self._endpoint = endpoint_url
        config = opts.get("config_kwargs") or {}
        self._style = (config.get("s3") or {}).get("addressing_style", "auto")
        self._default_region = region
        self._session = session  # botocore's, where a profile or config file is there; else made if needed
        self._regions: dict[str, str] = {}  # bucket -> the region S3 said it is in
        self._signed: dict[str, tuple[float, str, str]] = {}  # path -> (when, region, presigned URL)
        self._lock = threading.Lock()

        self._lock = threading.Lock()
        self._local = threading.local()  # this thread's connections, by (scheme, host), and its process

    def _credentials(self) -> Any:
        """The options' credentials, else AWS_* variables, else botocore's chain (what its
        first provider would read from the environment, read here without importing it)."""
        key, secret, token = self._given
        if key and secret:
            return Credentials(key, secret, token)
        env = os.environ
        if not self._profile and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
            return Credentials(
                env["AWS_ACCESS_KEY_ID"],
                env["AWS_SECRET_ACCESS_KEY"],
                env.get("AWS_SESSION_TOKEN") or env.get("AWS_SECURITY_TOKEN"),
            )
        if self._session is None:
            import botocore.session

            self._session = botocore.session.Session(profile=self._profile)
        found = self._session.get_credentials()
        if found is None:
            import botocore.exceptions

            raise botocore.exceptions.NoCredentialsError()
        return found.get_frozen_credentials()  # refreshed by botocore when they are about to expire

    @property
    def region(self) -> str:
        """The region GETs are signed for until S3 names a bucket's own."""
        return self._default_region

    def _region(self, bucket: str) -> str:
        return self._regions.get(bucket, self._default_region)

    def _object_url(self, bucket: str, key: str, region: str) -> str:
        """Path-style on an endpoint of the options' (what S3-compatible stores all serve),
        virtual-hosted on AWS's where the bucket's name allows, as botocore addresses them."""
        quoted = quote(key, safe="/~")
        if self._endpoint:
            u = urlsplit(self._endpoint)
            base = u.path.rstrip("/")
            if self._style == "virtual":
                return f"{u.scheme}://{bucket}.{u.netloc}{base}/{quoted}"
            return f"{u.scheme}://{u.netloc}{base}/{bucket}/{quoted}"
        host = f"s3.{region}.amazonaws.com"
        if self._style != "path" and _VIRTUAL_HOSTABLE.fullmatch(bucket):
            return f"https://{bucket}.{host}/{quoted}"
        return f"https://{host}/{bucket}/{quoted}"

    def _url(self, path: str) -> tuple[str, str]:
        """A presigned URL for GETs of `path`, and the region it is signed for."""
        now = time.monotonic()
        bucket, _, key = path.partition("/")
        region = self._region(bucket)
        signed = self._signed.get(path)
        if signed is not None and now - signed[0] <= PRESIGN_TTL_S and signed[1] == region:
            return signed[2], region
        url = self._sign("GET", self._object_url(bucket, key, region), region)
        with self._lock:
            if len(self._signed) >= _SIGNED_KEPT:
                self._signed = {p: s for p, s in self._signed.items() if now - s[0] <= PRESIGN_TTL_S}
            self._signed[path] = (now, region, url)
        return url, region

    def _sign(self, method: str, url: str, region: str) -> str:
        """`url` presigned for `method` (SigV4 query auth: the payload unsigned), or as it is (anon)."""
        if self._anon:
            return url
        from botocore.auth import S3SigV4QueryAuth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method=method, url=url)
        S3SigV4QueryAuth(self._credentials(), "s3", region, expires=int(PRESIGN_TTL_S * 12)).add_auth(request)
        return str(request.url)

    def _part_url(self, path: str, upload_id: str, number: int) -> tuple[str, str]:
        """A presigned URL for the PUT of part `number` of multipart upload `upload_id` of
        `path`, and the region it is signed for (not kept: each part is signed once)."""
        bucket, _, key = path.partition("/")
        region = self._region(bucket)
        query = urlencode({"partNumber": number, "uploadId": upload_id}, quote_via=quote)
        return self._sign("PUT", f"{self._object_url(bucket, key, region)}?{query}", region), region
