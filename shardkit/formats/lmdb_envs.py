"""This process's read-only LMDB environments: one per data.mdb file (LMDB allows no more),
opened on first use, shared by every reader and thread, reopened in a forked worker, and
checked for a file cut short (touching a page past its end would kill the process)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import CorruptShardError, DatasetNotFoundError
from .lmdb_records import DATA_FILE, is_lmdb, lmdb_module

_PAGE = 4096  # LMDB's smallest page; a data.mdb starts with two meta pages


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
            found = _Env(pid, path, file, open_readonly(path, readahead))
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


def open_readonly(path: str, readahead: bool) -> Any:
    lmdb = lmdb_module()
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
