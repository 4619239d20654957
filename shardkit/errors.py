"""Exceptions. Every error shardkit raises on bad input is a ShardkitError with a one-line
message naming the file, shard or URL; subclasses also derive from the builtin a caller would
expect, so `except ValueError` and `except FileNotFoundError` keep working."""


import errno
import re

_USERINFO = re.compile(r"(\b[a-zA-Z][\w+.-]*://)[^/\s]*@")  # up to the last @ of the host part: a password may hold one
_QUERY = re.compile(r"(\b[a-zA-Z][\w+.-]*://[^\s?]+)\?\S+")
_PARAMS = re.compile(r"\?[^\s?#=&'\"]+=[^\s'\"]*")  # ?key=value... of a URL that lost its scheme:// (a path)


def one_line(e: BaseException | str) -> str:
    """An error's message on one line (clients' messages can span several)."""
    return " ".join(str(e).split())


def redact(text: str) -> str:
    """Hide credentials that URLs can carry: user info (`https://user:pw@host`) and query
    strings (presigned-URL signatures, WebHDFS delegation tokens) become '***'."""
    return _PARAMS.sub("?***", _QUERY.sub(r"\1?***", _USERINFO.sub(r"\1***@", text)))


_ABOUT_THE_FILE = frozenset({errno.ELOOP, errno.ENAMETOOLONG, errno.ENXIO})


def about_the_file(e: OSError) -> bool:
    """Whether an error reading a source file is about that file (gone since the scan,
    not readable by us, not a file, a bad name): a pack skips it and reports it. Any other
    (too many open files, out of memory, an I/O error, a stale network mount) is about the
    machine and would hit every file after it: the pack stops instead of turning an outage
    into a smaller dataset, and a rerun resumes it."""
    return (isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))
            or e.errno is None  # not the system's: PIL's "Truncated File Read", a store's 404
            or e.errno in _ABOUT_THE_FILE)


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
