"""A local disk cache of byte ranges of remote shards, shared by every worker and rank on
a machine, capped in bytes.

Entries are filled from the bytes a read already downloaded (no second download), written
to a temporary name and renamed into place (a reader never sees a torn file), and named by
a hash of the shard's full URL, its sha256 from the index and the byte range: no credentials
or user names end up in file names, and a shard replaced under the same URL misses.
Eviction removes the least recently used entries (by mtime, refreshed on every hit) once
the total passes the cap. Processes coordinate through the file system only: an entry
evicted by one process while another reads it is simply a miss for the latter.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid

SUFFIX = ".blk"


class RangeCache:
    def __init__(self, root: str, limit: int):
        self.root, self.limit = root, limit
        os.makedirs(root, exist_ok=True)
        self._estimate = self._scan_size()  # bytes in the cache, as this process believes
        self.hits = self.misses = 0

    def _path(self, url: str, version: str | None, start: int, stop: int) -> str:
        name = hashlib.sha256(f"{url}\0{version}\0{start}\0{stop}".encode()).hexdigest()[:40]
        return os.path.join(self.root, name + SUFFIX)

    def get(self, url: str, version: str | None, start: int, stop: int) -> bytes | None:
        path = self._path(url, version, start, stop)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # most recently used
        except FileNotFoundError:
            self.misses += 1
            return None
        if len(data) != stop - start:  # cannot happen with rename-into-place; be safe anyway
            self.misses += 1
            return None
        self.hits += 1
        return data

    def put(self, url: str, version: str | None, start: int, stop: int, data: bytes) -> None:
        path = self._path(url, version, start, stop)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:  # a full or read-only cache disk must not stop training
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return
        self._estimate += len(data)
        if self._estimate > self.limit:
            self.evict()

    def _entries(self) -> list[tuple[float, int, str]]:
        out = []
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat()
                    out.append((st.st_mtime, st.st_size, entry.path))
        return out

    def _scan_size(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def evict(self) -> None:
        """Remove least recently used entries until the cache is at 90% of its cap."""
        entries = sorted(self._entries())
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= 0.9 * self.limit:
                break
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            total -= size
        self._estimate = total
