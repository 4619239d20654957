"""S3 ranged reads through s3torchconnector's CRT client (AWS's Mountpoint client),
`storage_options={"client": "crt"}`.

Ranged reads (`get`) and an object's details (`info`, `size_now`: a HEAD) go through the CRT
client; the index, listings and writes stay with presigned GETs and s3fs (PresignedS3Store).
Endpoint, region and addressing are the presigned path's (s3_http.Direct).

What the client cannot do, and so this store does not either:
- no If-Match on a GET: the store is not `conditional`, so a shard's ETag is checked by a
  HEAD when a worker first opens it (range_reader), and an object replaced after that is
  not caught by its reads (the checksum check, `verify=True`, still would be);
- no credentials in the storage options: it takes them from the AWS_* variables, a profile
  (`profile`) or the instance's role, as the CRT resolves them. Options holding a key that
  is not the environment's are refused, never silently replaced by other credentials;
- TLS against the system's certificates (AWS_CA_BUNDLE is not read);
- its own retries: with `max_attempts=1` it still retries throttling (503 SlowDown) and
  resets inside one GET (seen against the fault proxy: none reached this store), so the
  reader's AIMD never hears the store ask for fewer requests (`stats()["throttled"]` 0).

Fork: the CRT does not survive one (forks.py): a child forked after its parent read through
it crashed (SIGSEGV) in 4 of 6 runs though it made its own client, so it fails at its first
read with a line instead. Clients are joined at exit (a CRT thread left running then panics).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import threading
from typing import Any, NoReturn, cast

from ...errors import BadRequestError, ShardkitError
from .. import s3_http
from ..urls import StorageOptions, display
from .base import Sink
from .forks import starting
from .s3 import PresignedS3Store

JOIN_S = 5.0  # the most seconds the exit waits for the CRT's threads
_STATUS = re.compile(r"response_status: (\d{3})")
# what the CRT's errors say where they quote no status (mountpoint-s3-client's messages)
_SAID = ((re.compile(r"key does not exist|bucket does not exist|object was not found|NoSuchKey|NoSuchBucket"), 404),
         (re.compile(r"Forbidden|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|No signing credentials"), 403),
         (re.compile(r"Request throttled|SlowDown|Too Many Requests"), 503),
         (re.compile(r"invalid configuration"), 400))  # the client refused its own settings: no retry mends that

_clients: dict[tuple[int, int, str, bool], Any] = {}  # (pid, the options' Direct, region, virtual) -> client
_lock = threading.Lock()


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class CrtS3Store(PresignedS3Store):
    name = "s3 (crt)"
    conditional = False  # the CRT client sends no If-Match: pins are checked by a HEAD as a shard opens

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        """GET bytes [start, stop) through the CRT client, its parts handed to `sink` in order
        as they come (it splits a range into parts itself). Errors with a status raise as
        s3_http.HTTPStatusError (416: the object ends before `start`)."""
        bucket, key = self._where(url)
        try:
            for chunk in self._client(url, bucket).get_object(bucket, key, start, stop):
                sink.write(chunk)
        except ShardkitError:  # the sink's (a hedge that lost), or ours
            raise
        except Exception as e:
            _raise(e)
        return None

    def info(self, url: str, what: str = "") -> dict[str, Any]:
        bucket, key = self._where(url)

        def head() -> dict[str, Any]:
            try:
                found = self._client(url, bucket).head_object(bucket, key)
            except Exception as e:
                _raise(e)
            return {"name": f"{bucket}/{key}", "type": "file", "size": int(found.size), "ETag": found.etag,
                    "LastModified": found.last_modified}

        return cast(dict[str, Any], self.retried(url, what, head))

    def size_now(self, url: str) -> int:
        return int(self.info(url)["size"])

    @staticmethod
    def _where(url: str) -> tuple[str, str]:
        bucket, _, key = s3_http.path_of(url).partition("/")
        return bucket, key

    def _client(self, url: str, bucket: str) -> Any:
        """This process's CRT client for the endpoint and region, made at its first use."""
        direct = self.direct
        region, endpoint = direct._region(bucket), direct._endpoint or None
        virtual = self.endpoint_for(bucket)[1]  # botocore's choice of addressing, as the presigned path makes it
        key = (os.getpid(), id(direct), region, virtual)  # a Direct is one a process and set of options
        found = _clients.get(key)
        if found is not None:
            return found
        starting("crt", url)
        from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

        client = MountpointS3Client(region, user_agent_prefix="shardkit", profile=direct._profile,
                                    unsigned=direct._anon, endpoint=endpoint, force_path_style=not virtual,
                                    max_attempts=1)  # the caller retries
        with _lock:
            if not _clients:
                atexit.register(_close_all)
            return _clients.setdefault(key, client)

    def __init__(self, direct: s3_http.Direct, storage_options: StorageOptions | None = None, patient: bool = False,
                 instances: dict[tuple[Any, ...], Any] | None = None, url: str = ""):
        super().__init__(direct, storage_options, patient, instances)
        self._check_credentials(url)  # as the store is made: a dataset fails as it is built, not in its workers

    def _check_credentials(self, url: str) -> None:
        key, secret, token = self.direct._given
        env = os.environ
        if key and (key, secret, token or None) != (env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY"),
                                                     env.get("AWS_SESSION_TOKEN") or None):
            raise BadRequestError(f"{display(url)}: storage option client='crt' takes credentials from the AWS_* "
                                  "variables, a profile or the instance's role, not from the storage options (key, "
                                  "secret, token): set them in the environment, or use client='presigned'")


def _close_all() -> None:
    """At exit: the clients dropped and their threads joined, before the interpreter goes (a
    CRT thread still running then calls into it, and panics)."""
    from s3torchconnectorclient._mountpoint_s3_client import join_all_managed_threads

    _clients.clear()
    with contextlib.suppress(Exception):
        join_all_managed_threads(JOIN_S)


def _status(e: BaseException) -> int | None:
    text = str(e)
    found = _STATUS.search(text)
    if found:
        return int(found.group(1))
    return next((status for pattern, status in _SAID if pattern.search(text)), None)


def _raise(e: Exception) -> NoReturn:
    """A CRT error as s3_http.HTTPStatusError where it tells a status; else as it is (no
    answer: a reset, a timeout, which the caller tries again)."""
    status = _status(e)
    if status is None:
        raise e
    raise s3_http.HTTPStatusError(status, str(e).splitlines()[0][:300]) from None
