"""The Store interface: one kind of storage, for the URLs of its schemes.

A store reads a range (`get`: one request, its bytes handed to a sink as they arrive, for
the caller's retries, hedges and parallel pieces), opens an object for reading, tells an
object's details (size, and the version marks that change when it is replaced), lists,
removes, makes or removes folders, and writes an object atomically (`writer`: locally a
temporary file renamed into place, on object stores an upload that appears only complete,
on S3 its parts sent several at once). URLs are the user's fsspec URLs, whole; storage options reach the client
unchanged.

Stores with `conditional_writes` (S3, GCS, Azure, local disk) also write small objects only
if they are as the caller last saw them, with the store's own conditional requests: created
only where there is none (S3's and Azure's `If-None-Match: *`, GCS's `ifGenerationMatch=0`), replaced
or removed only at the version read (`If-Match` the ETag, `ifGenerationMatch` the
generation). Two writers can never both succeed; a pack's lock on DEST is built on them
(packing/lock.py). A version is the store's own mark, as text. They are retried like the
rest: a write whose answer was lost on the way and that is tried again finds its own write
there and reports a failed condition, so a caller that must know reads the object back.

Errors: the operations here are retried (`retrying`: transient failures again, with
backoff) and fail as shardkit's errors naming the URL, never a secret; a missing object is
FileNotFoundError where "not there" is an answer (exists, size, listings) rather than a
failure. `get` is the one primitive left unretried: its caller resumes a range from where
its bytes stopped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, BinaryIO, ClassVar, Protocol

from ..patience import patience_for
from ..retry import retrying
from ..urls import StorageOptions, display


TMP_MARK = ".tmp-"  # what a file written aside is named with, before its rename into place


class Sink(Protocol):
    """Where a ranged read's bytes go, in order (streams.Arriving)."""

    def write(self, chunk: bytes) -> None: ...

    def receive(self, readinto: Callable[[memoryview], int]) -> None: ...


class Store(ABC):
    """How one kind of storage is read and listed. `name` is what `stats()` and messages
    call it; `conditional` stores carry a shard's pinned version on every ranged read
    (If-Match), so nothing needs checking when a shard is first opened."""

    name: ClassVar[str]
    conditional: ClassVar[bool] = False
    conditional_writes: ClassVar[bool] = False

    def __init__(self, storage_options: StorageOptions | None = None, patient: bool = False):
        self.options = storage_options
        self.patient = patient  # its caller has reached the store already: ride out an outage

    def describe(self, url: str) -> dict[str, str]:
        """What reads `url` and how ("store": the client; an S3 store adds its endpoint,
        addressing, region and checksums, and why): `shardkit info -v` and `stats()` show it."""
        return {"store": self.name}

    def retried(self, url: str, what: str, fn: Callable[[], Any], throttled: Callable[[], None] | None = None) -> Any:
        """`fn()` under the retry policy and the options' patience (patience.py), failing with
        one line naming `url` (and `what`)."""
        wait = patience_for(url, self.options)
        return retrying(
            f"{display(url)}{what}", fn, wait.attempts(self.patient), throttled=throttled, stalls=wait.stalls
        )

    def retried_get(
        self, url: str, what: str, fn: Callable[[], Any], throttled: Callable[[], None] | None = None
    ) -> Any:
        """`fn()`, which calls `get`, retried as this store's GETs are: as `retried`, but for
        a store whose GETs go through another client than the rest (obstore_gcs.py)."""
        return self.retried(url, what, fn, throttled)

    @abstractmethod
    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        """One request for bytes [start, stop), handed to `sink` as they arrive (fewer where
        the object ends); the object's size where the answer tells it. Conditional stores
        send `pin` with it (a replaced object answers 412). Not retried: errors are raw."""

    @abstractmethod
    def writer(self, url: str) -> AbstractContextManager[BinaryIO]:
        """A file whose bytes appear under `url` only once it is complete and closed without
        error (an atomic put: a reader sees the old object or the whole new one, never half);
        an error inside the block leaves nothing new behind."""

    @abstractmethod
    def size_now(self, url: str) -> int:
        """The object's size, asked afresh (after a short read: did it end there?)."""

    @abstractmethod
    def cat(self, url: str) -> bytes:
        """The whole object."""

    @abstractmethod
    def open(self, url: str, what: str = "") -> BinaryIO:
        """The object, for reading in order (its reads retried; `what` said in a failure's line)."""

    @abstractmethod
    def info(self, url: str, what: str = "") -> dict[str, Any]:
        """The object's details, fsspec's shape: "size" and the store's version marks."""

    @abstractmethod
    def ls(self, url: str, detail: bool) -> list[Any]:
        """What is directly under a folder or prefix: names, or fsspec's details."""

    @abstractmethod
    def find(self, url: str) -> dict[str, dict[str, Any]]:
        """Every object under a prefix, recursively: {path: details}; {} where none."""

    @abstractmethod
    def remove(self, url: str) -> None:
        """Remove an object; one already gone is no error."""

    @abstractmethod
    def makedirs(self, url: str) -> None:
        """Make a folder (object stores have none: nothing)."""

    @abstractmethod
    def remove_dir(self, url: str) -> None:
        """Remove an empty folder, best effort (object stores have none: nothing)."""

    def read_versioned(self, url: str) -> tuple[bytes, str] | None:
        """A small object's bytes and its version (what `replace_if` and `remove_if` are
        given), or None where there is none."""
        raise NotImplementedError(f"{self.name}: no conditional writes")

    def put_if_absent(self, url: str, data: bytes) -> str | None:
        """Create the object holding `data` unless one is there: its version, or None (an
        object was there, unchanged by this)."""
        raise NotImplementedError(f"{self.name}: no conditional writes")

    def replace_if(self, url: str, data: bytes, version: str) -> str | None:
        """Replace the object with `data` if it is still at `version`: the new version, or
        None (it changed or went since, and is left as it is)."""
        raise NotImplementedError(f"{self.name}: no conditional writes")

    def remove_if(self, url: str, version: str) -> bool:
        """Remove the object if it is still at `version`: whether it was removed."""
        raise NotImplementedError(f"{self.name}: no conditional writes")
