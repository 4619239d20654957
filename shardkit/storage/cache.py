"""shardkit's local copies of remote data, and the one place that says where they go.

Under the cache root (`cache_dir`, see `root`), one folder per kind:

- `blocks/`: byte ranges of remote shards read once (RangeCache, below), kept only where a
  `cache_dir` is given, and capped by `cache_limit` (least recently used blocks go first).
- `lmdb/`: a whole copy of each remote LMDB read (an LMDB opens local files only), the
  latest version of each URL; without a `cache_dir`, under the default root. `cache_limit`
  refuses one larger than it (`whole_copy_fits`); the copies do not count towards the
  blocks' cap.
- `offsets/`: a copy of each remote tar dataset's offsets file (8 bytes a sample), named by
  its sha256; without a `cache_dir`, under the default root; never evicted.

A pack's copies of remote source shards are no cache: temporary files in TMPDIR, gone with
the job. Files of the earlier layout (blocks at the top of `cache_dir`, LMDB copies in
`lmdb-<digest>/`) are moved into place when met, so they are still found.

The block cache: byte ranges of remote shards, shared by every worker and rank on a
machine, capped in bytes.

Entries are filled from the bytes a read already downloaded (no second download), written
to a temporary name and renamed into place (a reader never sees a torn file), led by a
CRC-32 of their bytes (a block torn by a power cut, which rename alone does not rule out,
or damaged on disk is a miss and is removed, never handed out), and named by
a hash of the shard's full URL, its sha256 from the index and the byte range: no credentials
or user names end up in file names, and a shard replaced under the same URL misses.
Eviction removes the least recently used entries (by mtime, refreshed on every hit) once
the total passes the cap. Processes coordinate through the file system only: an entry
evicted by one process while another reads it is simply a miss for the latter. Each
process re-counts the folder whenever it has written 1% of the cap since it last looked,
so N processes filling one cache together overshoot it by at most ~N% (plus a block each).
Temporary files older than `STALE_S` belong to a writer that was killed: they are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import time
import uuid
import zlib

BLOCKS, LMDB, OFFSETS = "blocks", "lmdb", "offsets"  # the kinds of copy, each a folder under the root
DEFAULT_ROOT = "shardkit-cache"  # in the temporary folder, for the copies a read cannot do without
SUFFIX = ".blk"
_OLD_BLOCK = re.compile(r"[0-9a-f]{40}\.blk")  # a block at the top of the root, where they were kept before blocks/
_CRC = 4  # bytes of the CRC-32 (big-endian) that leads each entry
TMP = ".tmp-"
STALE_S = 600.0


class RangeCache:
    def __init__(self, root: str, limit: int):
        self.root, self.limit = root, limit
        os.makedirs(root, exist_ok=True)
        self._unseen = 0  # bytes this process wrote since it last counted the folder
        self.hits = self.misses = 0
        self._recount()

    def _path(self, url: str, version: str | None, start: int, stop: int) -> str:
        name = hashlib.sha256(f"{url}\0{version}\0{start}\0{stop}".encode()).hexdigest()[:40]
        return os.path.join(self.root, name + SUFFIX)

    def get(self, url: str, version: str | None, start: int, stop: int) -> bytes | None:
        path = self._path(url, version, start, stop)
        try:
            with open(path, "rb") as f:
                crc, data = f.read(_CRC), f.read()  # two reads: the block's bytes are not copied again
        except OSError:  # not cached, evicted meanwhile, or another user's and unreadable
            self.misses += 1
            return None
        if len(data) != stop - start or int.from_bytes(crc, "big") != zlib.crc32(data):
            self.misses += 1  # torn or damaged: downloaded again and written anew
            with contextlib.suppress(OSError):
                os.remove(path)
            return None
        with contextlib.suppress(OSError):  # another user's entry cannot be touched: it ages, it still serves
            os.utime(path)  # most recently used
        self.hits += 1
        return data

    def put(self, url: str, version: str | None, start: int, stop: int, data: bytes) -> None:
        path = self._path(url, version, start, stop)
        tmp = f"{path}{TMP}{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "wb") as f:
                f.write(zlib.crc32(data).to_bytes(_CRC, "big"))
                f.write(data)
            os.replace(tmp, path)
        except OSError:  # a full or read-only cache disk must not stop training
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return
        self._unseen += _CRC + len(data)
        if self._unseen >= self.limit / 100:
            self._recount()

    def _entries(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of the entries, and of temporary files being written (they
        take space too); stale temporary files are removed."""
        out = []
        now = time.time()
        for entry in os.scandir(self.root):
            with contextlib.suppress(OSError):  # gone meanwhile, or another user's: housekeeping never stops a read
                if entry.name.endswith(SUFFIX):
                    st = entry.stat()
                    out.append((st.st_mtime, st.st_size, entry.path))
                elif TMP in entry.name:
                    st = entry.stat()
                    if now - st.st_mtime <= STALE_S:
                        out.append((now, st.st_size, ""))  # counted, never evicted: its writer renames it
                    else:
                        os.remove(entry.path)
        return out

    def _recount(self) -> None:
        """Count the folder (what every process wrote) and evict if it is over the cap."""
        self._unseen = 0
        entries = self._entries()
        if sum(size for _, size, _ in entries) > self.limit:
            self._evict(entries)

    def _evict(self, entries: list[tuple[float, int, str]]) -> None:
        """Remove least recently used entries until the cache is at 90% of its cap."""
        entries = sorted(entries)
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= 0.9 * self.limit:
                break
            if path:
                with contextlib.suppress(OSError):
                    os.remove(path)
                total -= size


def root(cache_dir: str | None) -> str:
    """The cache root: `cache_dir`, or (None) `DEFAULT_ROOT` in the temporary folder (TMPDIR)."""
    return cache_dir if cache_dir is not None else os.path.join(tempfile.gettempdir(), DEFAULT_ROOT)


def folder(kind: str, cache_dir: str | None) -> str:
    """Where copies of `kind` (BLOCKS, LMDB, OFFSETS) go under the cache root."""
    return os.path.join(root(cache_dir), kind)


def range_cache(cache_dir: str | None, limit: int) -> RangeCache | None:
    """The block cache under `cache_dir`, capped at `limit` bytes (None: no `cache_dir`, no
    block cache). Blocks the earlier layout kept at the top of `cache_dir` are moved in."""
    if cache_dir is None:
        return None
    blocks = folder(BLOCKS, cache_dir)
    with contextlib.suppress(OSError):  # no such folder yet, or another user's: nothing to move
        old = [e.name for e in os.scandir(cache_dir) if _OLD_BLOCK.fullmatch(e.name)]
        if old:
            os.makedirs(blocks, exist_ok=True)
        for name in old:
            with contextlib.suppress(OSError):  # moved by another process meanwhile
                os.replace(os.path.join(cache_dir, name), os.path.join(blocks, name))
    return RangeCache(blocks, limit)


def lmdb_copies(cache_dir: str | None, name: str) -> str:
    """The folder of the copies of one remote LMDB (`name`: a digest of its URL), its earlier
    place (`lmdb-<name>` at the top of the root) moved here when found."""
    here, before = folder(LMDB, cache_dir), os.path.join(root(cache_dir), f"lmdb-{name}")
    if os.path.isdir(before):
        with contextlib.suppress(OSError):  # moved by another process meanwhile: a copy is fetched at worst
            os.makedirs(here, exist_ok=True)
            os.rename(before, os.path.join(here, name))
    return os.path.join(here, name)


def whole_copy_fits(size: int, limit: int | None) -> bool:
    """Whether a whole copy of `size` bytes (an LMDB's) may be made: `cache_limit` bounds each
    one (None: no bound), apart from the blocks' cap."""
    return limit is None or size <= limit
