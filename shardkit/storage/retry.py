"""The retry policy: which failures are worth another attempt, backoff with full jitter,
and one-line errors naming the URL."""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from ..errors import AccessDeniedError, BadRequestError, NotFoundError, ShardkitError, one_line, redact, redacted
from .patience import RETRIES
from .urls import GCS


T = TypeVar("T")


_TRANSIENT_4XX = {408, 409, 425, 429}  # timeout, conflict, too early, throttled: worth another attempt
THROTTLED = {429, 503}  # the store asks for fewer requests (S3's SlowDown is a 503)
THROTTLED_BASE_S = 1.0  # ...so the backoff starts at a second: 5 attempts span up to ~15 s, not ~3 s (10: ~65 s)
_SAY = {NotFoundError: "not found (no such object, or no such bucket)", AccessDeniedError: "access denied"}
_BY_STATUS = {401: AccessDeniedError, 403: AccessDeniedError, 404: NotFoundError, 410: NotFoundError}


def _never() -> None:
    pass


_before_wait: Callable[[], None] = _never
_throttled_answers = 0  # this process's, every request's (a dataset's opening reads are counted by this)
_throttled_lock = threading.Lock()


def throttled_answers() -> int:
    """How many 503 SlowDown / 429 answers this process's retried requests have had so far."""
    return _throttled_answers


def stop_when(check: Callable[[], None]) -> None:
    """Have this process's retry loops call `check` before each wait: it raises to give up
    (the packer's job runner raises once the pack has been given up). Storage knows nothing
    of who stops it."""
    global _before_wait
    _before_wait = check


def retrying(
    what: str,
    fn: Callable[[], T],
    attempts: int = RETRIES,
    base_s: float = 0.2,
    cap_s: float = 10.0,
    throttled: Callable[[], None] | None = None,
    stalls: int | None = None,
) -> T:
    """Call `fn`, retrying transient failures (resets, timeouts, 5xx, throttling) with
    exponential backoff and full jitter. Fail with one line naming `what` (a URL: never the
    storage options): at once for an error no retry can fix (see `_permanent`), else after
    `attempts`, or after `stalls` of them timed out (a silent store is given up on sooner
    than one that refuses or errs, whose outage may end). A ShardkitError from `fn` passes
    unchanged. `throttled()` is called each time the store answers that it is overloaded
    (503 SlowDown, 429), before the wait."""
    stalled = 0
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except ShardkitError:
            raise
        except Exception as e:  # noqa: BLE001 - the remote client's errors have no common base
            stalled += timed_out(e)
            last = attempts if stalls is None or stalled < stalls else attempt
            failure = _failure(e, what, attempt, last)
            cause = redacted(e) if failure is not None else None
            slow_down = status_of(root_cause(e)) in THROTTLED
        # raised here, out of the except block, so that the client's own error (its message
        # may hold a presigned URL) is no __context__ either, of this or of a stop: only its
        # redacted copy is the cause
        if failure is not None:
            raise failure from cause
        _before_wait()  # a pack given up (Ctrl-C) tries no more: an attempt can take a minute
        if slow_down:
            count_throttled(throttled)
        base = max(base_s, THROTTLED_BASE_S) if slow_down else base_s
        time.sleep(random.uniform(0, min(cap_s, base * 2 ** (attempt - 1))))
    raise AssertionError("unreachable")


def count_throttled(throttled: Callable[[], None] | None = None) -> None:
    """One more throttled answer: this process's count, and the caller's `throttled()`."""
    global _throttled_answers
    with _throttled_lock:
        _throttled_answers += 1
    if throttled is not None:
        throttled()


def _failure(e: Exception, what: str, attempt: int, attempts: int) -> ShardkitError | None:
    """The error to raise for `e` on this attempt, in one line naming `what`; None where
    another attempt is worth it."""
    kind = _permanent(e)
    if kind is not None:
        reason = redact(one_line(e)).removeprefix(what).lstrip(": ")  # some name the URL, some only it
        if re.fullmatch(r"\S+://\S*", reason) or (reason and " " not in reason and reason in what):
            reason = _SAY.get(kind, "")  # gcsfs's 404 says nothing but the request's URL, s3fs's the path
        return kind(f"{what}: {reason or type(e).__name__}")
    if attempt < attempts:
        return None
    tries = f"{attempts} attempts" if attempts > 1 else "1 attempt"
    if attempts == 1 and what.startswith(tuple(f"{p}://" for p in GCS)):
        tries = "gcsfs's own retries"  # ours is 1 attempt: see Patience.attempts (obstore's GETs: ours)
    said = redact(one_line(e)) or ("no answer within the timeout" if timed_out(e) else "")
    hint = "; the storage options timeout= and attempts= set how long to wait" if timed_out(e) else ""
    return ShardkitError(f"{what}: {type(e).__name__}{': ' * bool(said)}{said} (gave up after {tries}{hint})")


def timed_out(e: BaseException) -> bool:
    """Whether `e` is a connection that stayed silent past its timeout (socket, asyncio and
    aiohttp timeouts are TimeoutErrors; requests', urllib3's and botocore's say so by name)."""
    return any(isinstance(c, TimeoutError) or "Timeout" in type(c).__name__ for c in _causes(e))


def _causes(e: BaseException) -> Iterator[BaseException]:
    """`e`, the error it was raised from, and so on down (8 causes at most)."""
    for _ in range(9):
        yield e
        if e.__cause__ is None:
            return
        e = e.__cause__


def root_cause(e: BaseException) -> BaseException:
    """The last of `_causes`: fsspec's HTTP client raises FileNotFoundError from a 403 or a
    refused connection alike, so the cause is what tells."""
    *_, root = _causes(e)
    return root


# A connection dropped, or a body cut short: worth another attempt, wherever in the chain of
# causes (aiohttp's parse errors carry a `code` of 400 that is no HTTP status).
_CUT_SHORT = {
    "ClientPayloadError",
    "ServerDisconnectedError",
    "ClientConnectionError",
    "HttpProcessingError",
    "IncompleteRead",
    "ChunkedEncodingError",
    "ResponseStreamingError",
    "IncompleteReadError",
}


def _cut_short(e: BaseException) -> bool:
    return any(c.__name__ in _CUT_SHORT for cause in _causes(e) for c in type(cause).__mro__)


def status_of(e: BaseException) -> int | None:
    """The HTTP status a client's error carries: aiohttp's `status`, gcsfs's `code`,
    requests' `response.status_code`, botocore's response metadata."""
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        found = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    elif response is not None:
        found = getattr(response, "status_code", None)
    else:
        found = getattr(e, "status", None) or getattr(e, "code", None)
    return found if isinstance(found, int) and 100 <= found < 600 else None


def _from_botocore(e: BaseException, *names: str) -> bool:
    return any(c.__name__ in names and c.__module__.startswith("botocore") for c in type(e).__mro__)


def _permanent(e: BaseException) -> type[ShardkitError] | None:
    """The kind of error to raise for a failure no retry can fix, judged by its root cause;
    None for one worth retrying."""
    if _cut_short(e):
        return None
    e = root_cause(e)
    status = status_of(e)
    if status is not None:
        if 300 <= status < 400:  # a redirect the client did not follow: another attempt is sent the same way
            return BadRequestError
        return _BY_STATUS.get(status, BadRequestError) if 400 <= status < 500 and status not in _TRANSIENT_4XX else None
    if isinstance(e, FileNotFoundError):
        return NotFoundError
    if (
        isinstance(e, PermissionError)
        or _from_botocore(e, "NoCredentialsError", "PartialCredentialsError")
        or (type(e) is OSError and str(e).startswith("Forbidden"))
    ):  # gcsfs's HTTP 403
        return AccessDeniedError
    if isinstance(e, (ValueError, TypeError, IsADirectoryError, NotADirectoryError, FileExistsError)) or _from_botocore(
        e, "ParamValidationError"
    ):  # an invalid bucket name, request or option (a typo)
        return BadRequestError
    return None
