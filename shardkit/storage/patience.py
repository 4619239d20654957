"""How long a request may take: shardkit's own two storage options, beside the client's.

    timeout   seconds a connection may stay silent (nothing received while an answer is
              awaited or a body read) before the request fails and is tried again. A
              slow body that keeps moving is never cut off: the deadline is per socket
              read, not per request. Default 20; on GCS 5, because gcsfs tries every
              request 6 times itself (no option changes that), so 5 s a try bounds a
              stall to about a minute there too
              (obstore's GCS reads, retried by shardkit: 20, as on S3).
    attempts  tries at a request before it fails. Default 5; a dataset's reads once it has
              read its index 10 (an outage or a restart of the store is ridden out); a
              request that stalls (its `timeout` passed) is tried at most 3 times, so a
              stalled store fails a read in about a minute, not after 10 timeouts.

Both are read here and taken out of the options before a client sees them. From the
command line: `-o timeout=5 -o attempts=2`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import BadRequestError
from .urls import GCS, StorageOptions, scheme


OPTIONS = frozenset({"timeout", "attempts"})
CLIENT = "client"  # the other key of shardkit's own: which client reads a dataset's shards (stores/choice.py)
TIMEOUT_S = 20.0  # a connection silent this long fails its request (and it is tried again)
GCS_TIMEOUT_S = 5.0  # gcsfs tries each request 6 times: 6 x 5 s and its ~31 s of backoff
RETRIES = 5  # attempts at a request: a wrong endpoint or dead store fails in seconds
OUTAGE_RETRIES = 10  # a dataset's reads, once it has read its index: waits of up to ~43 s (~21 s on average),
# so a blip or a restart of the store does not end a training run
STALLS = 3  # tries at a request that stalls: 3 x TIMEOUT_S, about a minute


@dataclass(frozen=True)
class Patience:
    """The timeout and attempts for one URL and its options (see the module's docstring)."""

    timeout_s: float
    given_attempts: int | None  # None: the defaults
    gcs: bool

    def attempts(self, patient: bool = False) -> int:
        """Our attempts at a request; `patient` ones ride out an outage. On GCS ours is 1:
        gcsfs retries every failed request up to 6 times itself, with backoff (a body cut
        short and a silent connection included), and those are not multiplied by ours."""
        if self.gcs:
            return 1
        if self.given_attempts is not None:
            return self.given_attempts
        return OUTAGE_RETRIES if patient else RETRIES

    @property
    def stalls(self) -> int:
        return min(STALLS, self.attempts(patient=True))


def patience_for(url: str, storage_options: StorageOptions | None, *, gcsfs: bool = True) -> Patience:
    """The Patience that `storage_options` ask for at `url`; a bad value is one line. `gcsfs`:
    whether gcsfs makes a gs:// URL's requests (False: obstore's GETs, which shardkit retries
    as it retries S3's, stores/obstore_gcs.py)."""
    opts = storage_options or {}
    gcs = scheme(url) in GCS and gcsfs
    timeout = opts.get("timeout", GCS_TIMEOUT_S if gcs else TIMEOUT_S)
    attempts = opts.get("attempts")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise BadRequestError(f"storage option timeout={timeout!r}: expected seconds, a number above 0")
    if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1):
        raise BadRequestError(f"storage option attempts={attempts!r}: expected a whole number, 1 or more")
    return Patience(float(timeout), attempts, gcs)


def client_options(storage_options: StorageOptions | None) -> dict[str, Any] | None:
    """The options without shardkit's own (these two and `CLIENT`): what a client is given."""
    own = OPTIONS | {CLIENT}
    if not storage_options or not own & storage_options.keys():
        return storage_options
    return {k: v for k, v in storage_options.items() if k not in own}
