"""Writing an LMDB dataset: samples and a pack's progress in one transaction each, the map
grown as the data does, a failed write told in one line with its likely cause."""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import CorruptShardError, DatasetNotFoundError, ShardkitError, SourceError, one_line
from .lmdb_envs import close_reader, open_readonly
from .lmdb_records import DATA_FILE, INDEX_KEY, PROGRESS_KEY, is_lmdb, lmdb_module

_INITIAL_MAP = 1 << 30


class Writer:
    """Appends samples in transactions; the map grows instead of failing with MDB_MAP_FULL."""

    def __init__(self, path: str):
        lmdb = lmdb_module()
        self._lmdb, self.path = lmdb, path
        close_reader(path)
        if is_lmdb(path):  # one that is not an LMDB, or is cut short, is refused here, not met with SIGBUS
            try:
                open_readonly(path, False).close()
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
