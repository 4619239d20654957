"""LMDB datasets: one record per tar-style member, key `KEY.EXT`, value the raw bytes, plus
the dataset's index document under `__index__`. A reader needs nothing but `lmdb`:

    env = lmdb.open("photos.lmdb", readonly=True, lock=False)
    with env.begin() as txn:
        index = json.loads(txn.get(b"__index__"))
        key = index["keys"][0]
        image, label = txn.get(f"{key}.jpg".encode()), int(txn.get(f"{key}.cls".encode()))

Keys are zero-padded sample numbers, so a sample's members are adjacent in LMDB's sorted
key order and one cursor walk collects them. Writing happens in transactions, each also
recording how far the pack got (`__progress__`), so a killed pack leaves a database that is
consistent, resumable, and never taken for finished: `__index__` is written last.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, wait
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from ..errors import CorruptShardError, DatasetNotFoundError, ShardkitError, SourceError, UnfinishedPackError, one_line

T = TypeVar("T")
R = TypeVar("R")
INDEX_KEY = b"__index__"
PROGRESS_KEY = b"__progress__"
DATA_FILE = "data.mdb"  # the lmdb library's name for its data file: a folder holding one is an LMDB
LOCK_FILE = "lock.mdb"
_INITIAL_MAP = 1 << 30
MAX_KEY = 511  # bytes: LMDB's limit on a key (as the lmdb package builds it)
_PAGE = 4096  # LMDB's smallest page; a data.mdb starts with two meta pages


def _lmdb() -> Any:
    try:
        import lmdb
    except ImportError:
        raise ShardkitError("LMDB support is not installed (pip install lmdb)") from None
    return lmdb


def sample_tables(extra: Mapping[str, Any]) -> tuple[Any, Any]:
    """An LMDB index's per-sample tables as numpy arrays (no per-key objects to copy on
    fork): the keys as UTF-8 bytes (`.decode()` gives one back), and the sizes (None where
    the index has none)."""
    import numpy as np

    sizes = extra.get("sizes")
    return (
        np.array([k.encode() for k in extra["keys"]], dtype="S"),
        None if sizes is None else np.array(sizes, dtype=np.int64),
    )


def is_lmdb(path: str) -> bool:
    return os.path.isfile(os.path.join(path, DATA_FILE))


def check_keys(key: str, fields: Mapping[str, bytes]) -> None:
    """Refuse a sample whose records' keys LMDB cannot hold (a long key from another tool's tar)."""
    longest = max(len(f"{key}.{ext}".encode()) for ext in fields)
    if longest > MAX_KEY:
        raise CorruptShardError(f"sample key {key[:60]!r}...: {longest} bytes as an LMDB key, over LMDB's {MAX_KEY}")


class Writer:
    """Appends samples in transactions; the map grows instead of failing with MDB_MAP_FULL."""

    def __init__(self, path: str):
        lmdb = _lmdb()
        self._lmdb, self.path = lmdb, path
        close_reader(path)
        if is_lmdb(path):  # one that is not an LMDB, or is cut short, is refused here, not met with SIGBUS
            try:
                _open(path, False).close()
            except (DatasetNotFoundError, CorruptShardError) as e:
                raise SourceError(f"{e}: pack into another folder, or remove it") from None
        try:
            self.env = lmdb.open(path, subdir=True, map_size=_INITIAL_MAP, readahead=False, meminit=False)
        except lmdb.Error as e:  # not writable, data.mdb a folder or a dangling link: LMDB's words, one line
            raise SourceError(f"{path}: cannot write an LMDB there ({one_line(e)})") from None

    def progress(self) -> dict[str, Any] | None:
        with self.env.begin() as txn:
            raw = txn.get(PROGRESS_KEY)
        return json.loads(raw) if raw else None

    def finished(self) -> bytes | None:
        with self.env.begin() as txn:
            found: bytes | None = txn.get(INDEX_KEY)
            return found

    def entries(self) -> int:
        return int(self.env.stat()["entries"])

    def write(
        self,
        samples: Sequence[tuple[str, Mapping[str, bytes]]],
        meta: Mapping[bytes, bytes],
        delete: Sequence[bytes] = (),
    ) -> None:
        """Put samples and `meta` records and delete `delete` in one transaction (all or nothing)."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for key, fields in samples:
                        for ext in sorted(fields):
                            if not txn.put(f"{key}.{ext}".encode(), fields[ext], overwrite=False):
                                raise SourceError(
                                    f"{self.path}: sample key {key!r} comes twice in the source; an "
                                    "LMDB holds one record per KEY.EXT (pack to tar, which keeps both)"
                                )
                    for k, v in meta.items():
                        txn.put(k, v)
                    for k in delete:
                        txn.delete(k)
                return
            except self._lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)
            except self._lmdb.Error as e:  # the transaction is undone: what was committed before stays
                size = sum(len(v) for _, fields in samples for v in fields.values()) + sum(map(len, meta.values()))
                raise self._failed(e, size) from None

    def close(self) -> None:
        if self.env is not None:
            env, self.env = self.env, None
            try:
                env.sync(True)
            except self._lmdb.Error as e:
                raise self._failed(e, 0) from None
            finally:
                env.close()

    def _failed(self, e: Exception, size: int) -> ShardkitError:
        """One line for a write that failed: the path, then the cause where it can be told.
        A disk that fills up mid-write makes LMDB say only "Input/output error" (a short
        write), so the free space is looked at."""
        said = one_line(e)
        cause = _no_room(self.path, size)
        if cause is None and "No space left" in said:
            cause = "no space left on device"
        if cause is None:
            return ShardkitError(
                f"{self.path}: writing the LMDB failed ({said}); a rerun of the same `shardkit pack` "
                "resumes after the last job written"
            )
        return ShardkitError(
            f"{self.path}: writing the LMDB failed: {cause} (LMDB said: {said}); make room and rerun "
            "the same `shardkit pack`, which resumes after the last job written"
        )


def _no_room(path: str, size: int) -> str | None:
    """Why `size` more bytes would not fit in the LMDB at `path`, if that is the reason: its
    disk is (nearly) full, or the file is at the process's file size limit (`ulimit -f`)."""
    slack = 1 << 20  # LMDB writes pages, a transaction's tree pages and meta page besides its data
    try:
        disk = os.statvfs(path)
        used = os.path.getsize(os.path.join(path, DATA_FILE))
    except OSError:
        return None
    free = disk.f_bavail * disk.f_frsize
    if free < size + slack:
        return f"no space left on device ({free} bytes free on its disk, the write needed {size} and more)"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and used + size + slack > limit:
        return f"data.mdb ({used} bytes) reached this process's file size limit (ulimit -f: {limit} bytes)"
    return None


class _File(NamedTuple):
    """A data.mdb as found on disk: its inode (device and number), then its size and
    modification time (the same inode written since is another _File)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int


def _inode(file: _File | None) -> tuple[int, int] | None:
    return None if file is None else (file.dev, file.ino)


@dataclass(eq=False)
class _Env:
    """An environment this process (`pid`) opened, on the data.mdb `file` that `path` held then."""

    pid: int
    path: str
    file: _File | None
    env: Any


_ENVS: list[_Env] = []
_READERS: dict[str, _Env] = {}  # path as given -> its environment
_OPENING = threading.Lock()


def _new_lock_in_child() -> None:
    """A DataLoader worker forked while another thread held the lock (opening a dataset)
    would wait on it forever."""
    global _OPENING
    _OPENING = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def open_reader(path: str, readahead: bool = False, fresh: bool = False) -> Any:
    """This process's read-only environment for `path`, opened on first use: no lock-file
    writes, and no OS readahead by default (random access; pass readahead=True for large
    records on a cold page cache; the first opener of a file decides). Shared by every
    reader in the process and its threads, never closed by them: a reader of a copy deleted
    since (a remote LMDB fetched again) reads on from its open file. One inherited through
    fork is closed and reopened: it must not be used there. With `fresh` (a dataset being
    built), a data.mdb replaced since it was opened (another inode) is opened anew, and one
    written in place (a pack finished by another process) keeps its environment, checked
    again for truncation.

    LMDB allows one environment per file and process, so one is found by its file, not by
    how the path is spelled (`db`, `./db/`, a symlink)."""
    pid = os.getpid()
    found = _READERS.get(path)
    if found is not None and found.pid == pid and not fresh:
        return found.env
    with _OPENING:  # threads must not race to open one file twice
        file = _identity(path)
        found = _READERS.get(path)
        if found is not None and found.pid == pid and (not fresh or found.file == file):
            return found.env
        for inherited in [e for e in _ENVS if e.pid != pid]:
            _forget(inherited)
        found = _env_on(file)
        if found is None:
            found = _Env(pid, path, file, _open(path, readahead))
            _ENVS.append(found)
        elif (
            file is not None and found.file != file
        ):  # written in place since: the same environment, never closed under a reader
            _check_pages(found.env, path, file.size)
            found.file = file
        _READERS[path] = found
        return found.env


def _identity(path: str) -> _File | None:
    try:
        st = os.stat(os.path.join(path, DATA_FILE))
    except OSError:
        return None
    return _File(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _env_on(file: _File | None) -> _Env | None:
    """This process's environment on `file`'s inode, however its path was spelled."""
    return next((e for e in _ENVS if file is not None and _inode(e.file) == _inode(file)), None)


def _forget(found: _Env) -> None:
    """Close an environment, and forget every path that led to it."""
    _ENVS.remove(found)
    for alias in [p for p, e in _READERS.items() if e is found]:
        del _READERS[alias]
    found.env.close()


def _open(path: str, readahead: bool) -> Any:
    lmdb = _lmdb()
    if not is_lmdb(path):
        raise DatasetNotFoundError(f"{path}: not an LMDB dataset (no data.mdb){_no_data_hint(path)}")
    size = os.path.getsize(os.path.join(path, DATA_FILE))
    if size < 2 * _PAGE:  # LMDB itself would say only "Bad file descriptor"
        raise CorruptShardError(f"{path}: data.mdb is truncated ({size} bytes; an LMDB starts with 2 pages of {_PAGE})")
    while True:
        try:  # opened by its data file: lmdb would also know it by lock.mdb, which readers never use
            env = lmdb.open(
                os.path.join(path, DATA_FILE),
                subdir=False,
                readonly=True,
                lock=False,
                readahead=readahead,
                meminit=False,
                max_readers=1024,
            )
            break
        except lmdb.Error as e:
            gone = [found for found in _ENVS if _inode(_identity(found.path)) != _inode(found.file)]
            if "already open" not in str(e) or not gone:
                raise DatasetNotFoundError(f"{path}: not an LMDB dataset ({e})") from None
            for found in gone:  # a copy deleted since held this inode number: LMDB takes it for the same file
                _forget(found)
    try:
        _check_pages(env, path, size)
    except CorruptShardError:
        env.close()
        raise
    return env


def _check_pages(env: Any, path: str, size: int) -> None:
    """A data.mdb cut short still opens (its meta pages are at the front), but touching a
    page past the end kills the process with SIGBUS: compare with the pages LMDB uses."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    if size < needed:
        raise CorruptShardError(f"{path}: data.mdb is truncated ({size} bytes, its pages need {needed})")


def _no_data_hint(path: str) -> str:
    try:
        with open(os.path.join(path, "index.json"), "rb") as f:
            kind = json.load(f).get("kind", "tar")
    except (OSError, ValueError, AttributeError):
        return ""
    if kind == "lmdb":
        return ": its index.json is an LMDB dataset's, data.mdb is gone (deleted, or not copied with it)"
    return " (tar shards: read them with StreamingDataset)"


def close_reader(path: str) -> None:
    """Close this process's reader of `path`, however spelled (before writing to it)."""
    with _OPENING:
        found = _READERS.get(path)
        if found is None:
            found = _env_on(_identity(path))
        if found is not None:
            _forget(found)


def read_index(env: Any, path: str) -> bytes:
    lmdb = _lmdb()
    try:
        with env.begin() as txn:
            raw = txn.get(INDEX_KEY)
    except lmdb.MapResizedError:
        raise _grown(path) from None
    except lmdb.Error as e:
        raise CorruptShardError(f"{path}: unreadable LMDB ({e})") from None
    if raw is None:
        with env.begin() as txn:
            unfinished = (
                txn.get(PROGRESS_KEY) is not None or not env.stat()["entries"]
            )  # none: killed before its first commit
        if unfinished:
            raise UnfinishedPackError(
                f"{path}: a pack into this LMDB has not finished (rerun the same `shardkit pack` to finish it)"
            )
        raise CorruptShardError(f"{path}: no {INDEX_KEY.decode()} record: an LMDB that `shardkit pack` did not write")
    return bytes(raw)


def _members(cur: Any, prefix: bytes) -> Iterator[bytes]:
    """The keys `KEY.EXT` of one sample (`prefix` is `KEY.`), the cursor on each in turn.
    Records of a folder named like the key plus a dot (`v1.2/x` beside `v1`) are another
    sample's: jumped over."""
    more = cur.set_range(prefix)
    while more:
        k = bytes(cur.key())  # a memoryview in a buffers=True transaction
        if not k.startswith(prefix):
            return
        slash = k.find(b"/", len(prefix))
        if slash >= 0:
            more = cur.set_range(k[:slash] + b"0")  # past that folder ("0" follows "/")
            continue
        yield k
        more = cur.next()


def read_sample(txn: Any, key: str, path: str, size: int | None = None) -> dict[str, bytes]:
    """All members `KEY.EXT` of one sample; with `size` (the index's), checked to add up to
    it (a record grown or shrunk in place is refused, not read as the sample)."""
    prefix = f"{key}.".encode()
    fields: dict[str, bytes] = {}
    total = 0
    try:
        with txn.cursor() as cur:
            for k in _members(cur, prefix):
                v = cur.value()
                total += len(v)
                if size is not None and total > size:
                    break
                fields[k[len(prefix) :].decode()] = bytes(v)
    except _lmdb().Error as e:
        raise CorruptShardError(f"{path}: sample {key}: unreadable LMDB ({e})") from None
    if not fields:
        raise CorruptShardError(f"{path}: sample {key} is missing")
    if size is not None and total != size:
        found = f"more than {total} bytes" if total > size else f"{total} bytes in {', '.join(sorted(fields))}"
        raise CorruptShardError(
            f"{path}: sample {key}: {found}, the index says {size} (a member "
            f"{'grown or added' if total > size else 'missing or shrunk'})"
        )
    return fields


COLD_READ_S = 0.001  # a read from the disk takes longer (cached: ~50 us here)

if hasattr(resource, "RUSAGE_THREAD"):  # Linux

    def major_faults() -> int:
        """This thread's major page faults: waits for the storage under the page cache."""
        return resource.getrusage(resource.RUSAGE_THREAD).ru_majflt
else:
    major_faults = itertools.count().__next__  # a number that changes at every call: the clock alone decides


def read_when_cold(
    read: Callable[[T], R], touch: Callable[[T], None], items: Sequence[T], pool: Callable[[], Executor] | None
) -> Iterator[R]:
    """`read(item)` for each item, in order, on this thread. Once a read waited for the disk,
    `pool()`'s threads `touch` all the rest at once (fault their pages in; see `touch_one`)
    and each is read as soon as its touch is done. Why: py-lmdb faults in every 4 KB page of
    a value before returning it, and without readahead each page is its own disk read, one
    after another (~3 ms for a 100 KB image here); with many reads in flight the disk's
    queue does the work. While the page cache has them, no thread: the hand-off would cost
    more than the read. Waited for the disk: slower than COLD_READ_S *and* with a major page
    fault; on a busy machine a cached read is often slow (the process lost its core), and a
    major fault can be quick (a virtual disk served from its host's cache)."""
    for n, item in enumerate(items):
        faults, start = major_faults(), time.perf_counter()
        record = read(item)
        cold = time.perf_counter() - start > COLD_READ_S and major_faults() != faults
        yield record
        if cold and pool is not None and n + 1 < len(items):
            rest, threads = items[n + 1 :], pool()
            touches = [threads.submit(touch, item) for item in rest]
            for item, touched in zip(rest, touches):
                wait((touched,))  # a touch's error is left to the read, which reports it
                yield read(item)
            return


def touch_one(env: Any, key: str) -> None:
    """Bring sample `key`'s records into the page cache without copying them: py-lmdb faults a
    value's pages in (with the GIL released) when it hands out a buffer over it. A reading
    thread that copied the values instead would keep their memory in a malloc arena of its
    own (+20-40 MB over a DataLoader pass, growing with the threads and the cores)."""
    with env.begin(buffers=True) as txn, txn.cursor() as cur:
        for _ in _members(cur, f"{key}.".encode()):
            cur.value()


def read_one(env: Any, key: str, path: str, size: int | None = None) -> dict[str, bytes]:
    """All members of sample `key`, in a read transaction of its own (one per thread)."""
    try:
        txn = env.begin(buffers=True)
    except _lmdb().MapResizedError:
        raise _grown(path) from None
    except _lmdb().Error as e:  # the machine's (the reader table full), not the data's
        raise ShardkitError(f"{path}: cannot start a read ({e})") from None
    with txn:
        return read_sample(txn, key, path, size)


def _grown(path: str) -> ShardkitError:
    """A data.mdb written past this process's map (a pack finished in place meanwhile):
    adopting the new map would pull it from under this process's other readers."""
    return ShardkitError(
        f"{path}: data.mdb grew past its map since this process opened it (a pack finished "
        "meanwhile): read it from a new process"
    )
