"""Reading a window of LMDB samples: in order on the calling thread while the page cache
has them; once a read waited for the disk, the rest faulted in by threads at once."""

from __future__ import annotations

import itertools
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, wait
from typing import Any, TypeVar

from .lmdb_records import members

T = TypeVar("T")
R = TypeVar("R")
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
        for _ in members(cur, f"{key}.".encode()):
            cur.value()
