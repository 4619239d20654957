"""GCS ranged reads through obstore (Rust's object_store), `storage_options={"client": "obstore"}`.

Only `get`, a shard's ranged reads in a pass, goes through obstore; the index, listings and
writes stay with gcsfs (GcsStore). obstore is given what gcsfs is given: the same endpoint
(`endpoint_url`, else STORAGE_EMULATOR_HOST, as gcsfs reads them) and gcsfs's own
credentials (any `token` gcsfs takes; "anon": unsigned), so both clients reach the same
object the same way. Options obstore cannot apply are refused, naming them.

The pin: each GET asks for the shard's generation (`?generation=`, obstore's `version`).
GCS answers a generation that is no longer the object's with 404; where the object is still
there, that is a replaced shard (412 to the reader: "changed since its index was made").

Retries: obstore's are off, shardkit's (patience.py, as for S3) retry its GETs; gcsfs keeps
its own for the rest. Fork: as obstore_s3.py (forks.py).
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from typing import TYPE_CHECKING, Any

from ...errors import BadRequestError
from ..patience import patience_for
from ..retry import retrying
from ..s3_http import HTTPStatusError
from ..urls import StorageOptions, display
from .base import Sink
from .forks import starting
from .fsspec import GcsStore
from .obstore_s3 import CHUNK, _said, _status

if TYPE_CHECKING:
    from collections.abc import Callable

    from obstore import GetOptions
    from obstore.store import ClientConfig

PUBLIC = "https://storage.googleapis.com"
_TIMEOUT = "kind: Timeout"  # how object_store's error says its client's timeout passed
UNAPPLIED = ("requester_pays", "session_kwargs")  # gcsfs options obstore's GETs would not carry
TOKEN_TTL = datetime.timedelta(minutes=5)  # a token without an expiry is asked of gcsfs again after this

# (pid, bucket, the options as text) -> (the options, obstore's GCSStore): one a process, bucket and
# options, however many readers (each has a gcsfs client of its own); the options are kept, so
# that the ids of the objects in them (a credentials object) are not reused by others'
_stores: dict[tuple[int, str, str], tuple[Any, Any]] = {}
_lock = threading.Lock()


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def unapplied(url: str, storage_options: StorageOptions | None) -> None:
    """Refuse, in a line naming `url`, options that obstore's GETs could not apply."""
    found = sorted(k for k in UNAPPLIED if (storage_options or {}).get(k))
    if found:
        raise BadRequestError(
            f"{display(url)}: storage option client='obstore' cannot apply the storage option(s) "
            f"{', '.join(found)}; client='gcsfs' can"
        )


class ObstoreGcsStore(GcsStore):
    name = "gcs (obstore)"
    conditional = True  # every GET carries the pinned generation

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        """GET bytes [start, stop) through obstore, of the pinned generation, each chunk handed
        to `sink` as it comes; the object's size. Errors that carry an HTTP status raise as
        HTTPStatusError (416: the object ends before `start`; 412: replaced)."""
        import obstore

        fs, path = self.client(url)
        bucket, key, _ = fs.split_path(path)
        options: GetOptions = {"range": (start, stop)}
        generation = (pin or {}).get("generation")
        if generation:
            options["version"] = str(generation)
        try:
            result = obstore.get(self._obstore(url, fs, bucket), key, options=options)
            for chunk in result.stream(min_chunk_size=CHUNK):
                sink.write(chunk)
            return int(result.meta["size"])
        except (obstore.exceptions.BaseError, FileNotFoundError, PermissionError) as e:  # its 404 and 403: builtins
            status = _status(e)
            if status is None and _TIMEOUT in str(e):  # a silent connection: one of the options' stalls (retry.py)
                raise TimeoutError(_said(e)) from None
            if status is None:
                raise  # no answer (a reset): the caller tries again, from where the bytes stopped
            if status == 404 and generation and self._there(url):
                raise HTTPStatusError(412, f"generation {generation} is no longer the object's") from None
            raise HTTPStatusError(status, _said(e)) from None

    def retried_get(
        self, url: str, what: str, fn: Callable[[], Any], throttled: Callable[[], None] | None = None
    ) -> Any:
        """GETs through obstore, retried by shardkit (gcsfs's own retries do not reach them)."""
        wait = patience_for(url, self.options, gcsfs=False)
        return retrying(
            f"{display(url)}{what}", fn, wait.attempts(self.patient), throttled=throttled, stalls=wait.stalls
        )

    def _there(self, url: str) -> bool:
        try:
            self.size_now(url)
        except FileNotFoundError:
            return False
        return True

    def _obstore(self, url: str, fs: Any, bucket: str) -> Any:
        """This process's obstore store for the bucket and options, made at its first read,
        signed with the credentials of the gcsfs client `fs` (one of these options)."""
        key = (os.getpid(), bucket, _as_text(self.options))
        found = _stores.get(key)
        if found is not None:
            return found[1]
        from obstore.store import GCSStore

        silence = f"{patience_for(url, self.options, gcsfs=False).timeout_s:g}s"
        base = _endpoint(self.options)
        client: ClientConfig = {
            "allow_http": base.startswith("http://"),
            "timeout": "24h",
            "connect_timeout": silence,
            "read_timeout": silence,
        }
        anon = fs.credentials.credentials is None  # token="anon", or gcsfs found no credentials and reads anonymously
        auth: dict[str, Any] = {"skip_signature": True} if anon else {"credential_provider": lambda: _token(fs)}
        store = GCSStore(bucket, base_url=base, client_options=client, retry_config={"max_retries": 0}, **auth)
        starting("obstore", url)
        with _lock:
            return _stores.setdefault(key, (self.options, store))[1]


def _as_text(storage_options: StorageOptions | None) -> str:
    """The options as a key: values that are not JSON (a credentials object) by their identity."""
    return json.dumps(storage_options or {}, sort_keys=True, default=lambda v: f"{type(v).__name__}@{id(v)}")


def _endpoint(storage_options: StorageOptions | None) -> str:
    """Where gcsfs sends requests: `endpoint_url`, else STORAGE_EMULATOR_HOST, else GCS."""
    found = (storage_options or {}).get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST") or PUBLIC
    found = str(found).rstrip("/")
    return found if "://" in found else f"http://{found}"


def _token(fs: Any) -> dict[str, Any]:
    """gcsfs's credentials (whatever `token` it was given), refreshed by gcsfs as it refreshes
    them, in obstore's shape (gcsfs's GoogleCredentials: `maybe_refresh`, `credentials`)."""
    fs.credentials.maybe_refresh()
    found = fs.credentials.credentials
    expiry = getattr(found, "expiry", None)  # google-auth's: naive, in UTC
    expires = (
        expiry.replace(tzinfo=datetime.timezone.utc)
        if expiry is not None
        else datetime.datetime.now(datetime.timezone.utc) + TOKEN_TTL
    )
    return {"token": str(found.token), "expires_at": expires}
