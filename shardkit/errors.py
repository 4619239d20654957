"""Exceptions. Every error shardkit raises on bad input is a ShardkitError with a one-line
message naming the file, shard or URL; subclasses also derive from the builtin a caller would
expect, so `except ValueError` and `except FileNotFoundError` keep working."""

import errno
import re
import threading
from collections.abc import Mapping
from typing import Any

_USERINFO = re.compile(r"(\b[a-zA-Z][\w+.-]*://)[^/\s]*@")  # up to the last @ of the host part: a password may hold one
_QUERY = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^\s?]+)\?\S*?(?=[:,;.)'\"]*(?:\s|$))")  # a sentence's ": " or "." kept
_PARAMS = re.compile(r"\?[^\s?#=&'\"]+=[^\s'\"]*")  # ?key=value... of a URL that lost its scheme:// (a path)


def one_line(e: BaseException | str) -> str:
    """An error's message on one line (clients' messages can span several)."""
    return " ".join(str(e).split())


def shown_name(name: str) -> str:
    """A file name as a message shows it: as it is where every character is printable, else
    with its control characters in repr's escapes (`a\\nError: x.jpg`, `\\x1b`) and its
    backslashes doubled, so that it stays on its line and cannot forge another."""
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() and c != "\\" else repr(c)[1:-1] for c in name)


def redact(text: str) -> str:
    """Hide credentials that URLs can carry: user info (`https://user:pw@host`) and query
    strings (presigned-URL signatures, WebHDFS delegation tokens) become '***', and so does
    every credential of the storage options this process was given (see `hide`)."""
    text = _PARAMS.sub("?***", _QUERY.sub(r"\1?***", _USERINFO.sub(r"\1***@", text)))
    hidden = _SECRETS.pattern
    return hidden.sub("***", text) if hidden is not None else text


_SECRET_NAME = re.compile(r"key|secret|token|passw|credential|signature|sas|auth|connection_str", re.IGNORECASE)
# the parts of an Azure connection string or SAS that are secrets: its key, its SAS, the SAS's signature
_SECRET_PARTS = (
    re.compile(r"(?:AccountKey|SharedAccessSignature)=([^;]+)", re.IGNORECASE),
    re.compile(r"\bsig=([^;&\s]+)"),
)
_NOT_SECRET = frozenset({"google_default", "anon", "browser", "cache", "cloud"})  # gcsfs's token modes
_SHORTEST_SECRET = 8  # "testing", "anon", "true": not worth hiding, and would hide parts of words


class _Secrets:
    """Credentials seen in this process's storage options, hidden by `redact`."""

    def __init__(self) -> None:
        self.values: set[str] = set()
        self.pattern: re.Pattern[str] | None = None
        self._lock = threading.Lock()

    def add(self, found: set[str]) -> None:
        with self._lock:
            if found <= self.values:
                return
            self.values |= found
            longest_first = sorted(self.values, key=len, reverse=True)
            self.pattern = re.compile("|".join(map(re.escape, longest_first)))


_SECRETS = _Secrets()


def hide(storage_options: Mapping[str, Any] | None) -> None:
    """Have `redact` hide, from every message of this process, the credentials these storage
    options carry: the text values under a name such as key, secret, token, password or
    credentials, however deep (`client_kwargs`, a token given as a dict)."""
    if storage_options:
        found = set(_secret_values(storage_options, False))
        if found:
            _SECRETS.add(found)


def _secret_values(value: Any, named: bool, depth: int = 0) -> list[str]:
    if isinstance(value, str):
        if not named or len(value) < _SHORTEST_SECRET or value in _NOT_SECRET:
            return []
        parts = [part for pattern in _SECRET_PARTS for part in pattern.findall(value) if len(part) >= _SHORTEST_SECRET]
        return [value, *parts]
    if depth > 8:
        return []
    if isinstance(value, Mapping):
        return [
            v
            for k, item in value.items()
            for v in _secret_values(item, named or bool(_SECRET_NAME.search(str(k))), depth + 1)
        ]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _secret_values(item, named, depth + 1)]
    return []


class RedactedError(Exception):
    """A lower layer's error (a storage client's) that a shardkit error was raised from, as it
    was raised but with its message redacted: the original could name a presigned URL or a
    credential. `kind` is the original's type; its traceback and chain are the original's."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def redacted(e: BaseException) -> RedactedError:
    """`e` and the errors it was raised from or during, each as a RedactedError: what to raise
    a shardkit error `from`, so that no printed traceback shows a secret."""
    copies: dict[int, RedactedError] = {}

    def copy(x: BaseException, depth: int) -> RedactedError:
        if id(x) in copies:
            return copies[id(x)]
        kind = f"{type(x).__module__}.{type(x).__qualname__}".removeprefix("builtins.")
        try:
            said = str(x)
        except Exception:  # noqa: BLE001 - a client's __str__ that fails: its type still tells
            said = ""
        out = copies[id(x)] = RedactedError(f"{kind}: {redact(said)}" if said else kind, kind)
        out.__traceback__ = x.__traceback__  # its frames: code lines, no values
        if depth < 16:
            if x.__cause__ is not None:
                out.__cause__ = copy(x.__cause__, depth + 1)
            if x.__context__ is not None:
                out.__context__ = copy(x.__context__, depth + 1)
        out.__suppress_context__ = x.__suppress_context__
        notes = getattr(x, "__notes__", None)  # Python 3.11's add_note
        if isinstance(notes, list):
            vars(out)["__notes__"] = [redact(str(n)) for n in notes]
        return out

    return copy(e, 0)


_ABOUT_THE_FILE = frozenset({errno.ELOOP, errno.ENAMETOOLONG, errno.ENXIO})


def about_the_file(e: OSError) -> bool:
    """Whether an error reading a source file is about that file (gone since the scan,
    not readable by us, not a file, a bad name): a pack skips it and reports it. Any other
    (too many open files, out of memory, an I/O error, a stale network mount) is about the
    machine and would hit every file after it: the pack stops instead of turning an outage
    into a smaller dataset, and a rerun resumes it."""
    return (
        isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))
        or e.errno is None  # not the system's: PIL's "Truncated File Read", a store's 404
        or e.errno in _ABOUT_THE_FILE
    )


def name_file(e: OSError, path: str) -> None:
    """Have a system error (one with an errno) that names no file name `path`."""
    if e.errno is not None and e.filename is None:
        e.filename = path


def describe(e: BaseException) -> str:
    """`Type: message` on one line, for errors raised inside a sample's reading or decoding."""
    return one_line(e) if isinstance(e, FieldError) else f"{type(e).__name__}: {one_line(e)}"


# How to get past bad samples, said by the readers' errors (the CLI says SKIP_BAD in its own words)
SKIP_BAD = 'on_error="skip" leaves bad samples out'
FIND_BAD = "`shardkit verify --decode` lists every bad sample, `shardkit pack --decode-check` keeps them out of a pack"


class FieldError(ValueError):
    """A sample's field that its decoder refused (or a transform decoding it, such as
    `image_transform`), named with the decoder's error. Bad data, but not a ShardkitError:
    the reader adds the shard and the sample before it is one, or skips it under
    on_error="skip"."""


class ShardkitError(Exception):
    """Base class of shardkit's errors. Messages are redacted of URL credentials."""

    def __init__(self, message: str = "", *args: object):
        super().__init__(redact(str(message)), *args)


class SourceError(ShardkitError, ValueError):
    """The input folder cannot be packed (missing, empty, no class folders, bad file)."""


class CorruptShardError(ShardkitError, ValueError):
    """A shard or its index does not hold what it should (truncated, checksum, count)."""


class DestinationBusyError(ShardkitError, RuntimeError):
    """Another pack is writing into this DEST (it holds DEST/.shardkit-lock)."""


class IndexVersionError(ShardkitError, ValueError):
    """index.json was written by a newer or unknown version of shardkit."""


class DatasetNotFoundError(ShardkitError, FileNotFoundError):
    """No index.json and no shards at the given location."""


class UnfinishedPackError(DatasetNotFoundError):
    """A pack into this folder has started and not finished: its index.json is not written yet."""


class NotFoundError(ShardkitError, FileNotFoundError):
    """No such object, bucket or path (HTTP 404 from a store, or a local shard gone)."""


class AccessDeniedError(ShardkitError, PermissionError):
    """The store refused: no credentials, or none with access (HTTP 401, 403)."""


class BadRequestError(ShardkitError, ValueError):
    """A request to a store that no retry can fix (an invalid bucket name, another HTTP 4xx)."""
