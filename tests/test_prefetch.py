"""Read-ahead, byte-range planning, the range cache and retries: with fake fetchers and
real files, no servers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any
from pathlib import Path

import numpy as np
import pytest

from shardkit.order import ranges
from shardkit import storage
from shardkit.storage.cache import RangeCache
from shardkit.errors import ShardkitError
from shardkit.reading.prefetch import Prefetcher


def test_results_in_order_with_reads_overlapping() -> None:
    in_flight, peak = 0, 0
    lock = threading.Lock()

    def fetch(i: int) -> bytes:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.02 if i % 3 else 0.05)  # out-of-order completion
        with lock:
            in_flight -= 1
        return bytes([i])

    got = list(Prefetcher(range(40), fetch, lambda i: 1, depth=8, budget=1000))
    assert [r for r, _ in got] == list(range(40))
    assert all(data == bytes([r]) for r, data in got)
    assert peak >= 4  # several reads really were in flight


def test_depth_zero_reads_in_the_consumer() -> None:
    threads = set()

    def fetch(i: int) -> bytes:
        threads.add(threading.current_thread().name)
        return b"x"

    assert len(list(Prefetcher(range(5), fetch, lambda i: 1, depth=0, budget=1))) == 5
    assert threads == {threading.current_thread().name}


def test_byte_budget_bounds_what_is_held() -> None:
    submitted: list[int] = []
    consumed = 0

    def fetch(i: int) -> bytes:
        submitted.append(i)
        return b"x" * 10

    for i, _ in Prefetcher(range(100), fetch, lambda i: 10, depth=16, budget=35):
        time.sleep(0.002)
        consumed = i + 1
        assert len(submitted) - consumed <= 4  # at most budget / size ahead (plus the one in hand)


@pytest.mark.parametrize("sizes", [[60] * 30, [99, 1, 1, 1, 99, 99, 50, 50, 99] * 4, [150, 10, 10, 150, 10]])
def test_byte_budget_is_never_exceeded(sizes: list[int]) -> None:
    """At most `budget` bytes fetched and not yet consumed, counting the request about to
    be sent; a request larger than the budget goes out alone."""
    lock = threading.Lock()
    held = peak = 0

    def fetch(size: int) -> int:
        nonlocal held, peak
        with lock:
            held += size
            peak = max(peak, held)
        return size

    for size, _ in Prefetcher(sizes, fetch, lambda size: size, depth=8, budget=100):
        time.sleep(0.005)
        with lock:
            held -= size
    assert peak <= max(100, max(sizes))


def test_interpreter_exit_does_not_wait_for_a_stalled_fetch() -> None:
    """A fetch stalled for minutes holds up neither close() nor the interpreter's exit."""
    script = """if True:
        import threading, time
        from shardkit.reading.prefetch import Prefetcher
        stalled = threading.Event()
        pf = Prefetcher(range(4), lambda i: (stalled.set(), time.sleep(120)), lambda i: 1, depth=2, budget=10)
        it = iter(pf)
        threading.Thread(target=lambda: next(it, None), daemon=True).start()
        assert stalled.wait(60)  # the fetch is running
        pf.close()  # what a `break` out of the loop does
    """
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=90)
    assert time.monotonic() - start < 60  # did not wait for the 120 s fetch (a start under load takes seconds)


def test_errors_surface_at_their_position() -> None:
    def fetch(i: int) -> bytes:
        if i == 7:
            raise OSError("boom")
        return b"x"

    seen = []
    with pytest.raises(OSError, match="boom"):
        for i, _ in Prefetcher(range(20), fetch, lambda i: 1, depth=4, budget=100):
            seen.append(i)
    assert seen == list(range(7))


def test_depth_adapts_to_latency() -> None:
    def slow(i: int) -> bytes:
        time.sleep(0.06)
        return b"x"

    p = Prefetcher(range(60), slow, lambda i: 1, depth=16, budget=10**9)
    for _ in p:
        time.sleep(0.003)  # a fast consumer of a slow store wants ~20 reads in flight (the depth: 16)
    assert 6 <= p.target <= 16
    q = Prefetcher(range(60), lambda i: b"x", lambda i: 1, depth=16, budget=10**9)
    for _ in q:
        time.sleep(0.003)  # an instant store needs one or two
    assert q.target <= 3


def test_reading_starts_with_one_read_alone() -> None:
    """The first range gets the whole bandwidth: nothing else is sent until it is taken."""
    started: list[int] = []
    first_done = threading.Event()

    def fetch(i: int) -> int:
        started.append(i)
        if i == 0:
            time.sleep(0.05)
            first_done.set()
        return i

    p = Prefetcher(range(20), fetch, lambda i: 1, depth=8, budget=100)
    it = iter(p)
    assert next(it) == (0, 0) and started == [0]
    assert [r for r, _ in it] == list(range(1, 20))


def test_reads_a_consumer_needs_together_go_out_together_then_double() -> None:
    """`start` reads are sent before any is taken (a shuffled first window needs each of
    its ranges); from there the reads in flight double as ranges are taken (slow start),
    up to what Little's law asks for."""
    started: list[int] = []
    all_sent = threading.Event()

    def fetch(i: int) -> int:
        started.append(i)
        if i < 3:
            if len(started) == 3:
                all_sent.set()
            all_sent.wait(5)  # none ends before all three are in flight (or 5 s)
            time.sleep(0.3)  # a slow first round trip
        else:
            time.sleep(0.02)  # a slow store: Little's law wants many in flight
        return i

    p = Prefetcher(range(40), fetch, lambda i: 1, depth=16, budget=100, start=3)
    it = iter(p)
    assert next(it) == (0, 0) and sorted(started[:3]) == [0, 1, 2]
    targets = [p.target for _ in it]
    assert targets[:3] == [6, 12, 16]  # 3 -> 6 -> 12 -> depth, one range taken each


def test_time_spent_waiting_for_bytes_is_not_the_consumers_own() -> None:
    """Little's law wants the consumer's own time per range: the time it waited for a
    streaming range's bytes (`stalled`) is read-ahead that was missing, so it raises the
    reads in flight instead of lowering them."""
    waited = [0.0]

    def slow(i: int) -> int:
        time.sleep(0.03)
        return i

    def consume(p: Prefetcher[int, int], stalling: bool) -> int:
        for _ in p:
            begun = time.perf_counter()
            time.sleep(0.03)  # waiting for bytes that have not come
            waited[0] += time.perf_counter() - begun if stalling else 0.0  # as long as it really took
        return p.target

    plain = consume(Prefetcher(range(40), slow, lambda i: 1, depth=16, budget=10**9), False)
    aware = consume(Prefetcher(range(40), slow, lambda i: 1, depth=16, budget=10**9, stalled=lambda: waited[0]), True)
    assert plain <= 6 and aware >= 12  # (about 2, and the depth)


def test_streaming_hands_over_before_the_fetch_ends() -> None:
    """A streaming fetch's consumer starts on what it handed over while the fetch goes on;
    the next range is sent once the consumer asks for it."""
    release, first_ended = threading.Event(), threading.Event()
    log: list[str] = []

    def fetch(i: int, hand_over) -> str:  # type: ignore[no-untyped-def]
        hand_over(f"buffer {i}")
        if i == 0:
            release.wait(5)
            first_ended.set()
        log.append(f"end {i}")
        return "unused"

    it = iter(Prefetcher(range(3), fetch, lambda i: 1, depth=4, budget=100, streaming=True))
    assert next(it) == (0, "buffer 0") and log == []  # handed over, still fetching
    release.set()
    assert [d for _, d in it] == ["buffer 1", "buffer 2"]
    assert first_ended.wait(5)  # on its own thread, which the consumer does not wait for


def test_throttling_halves_the_reads_in_flight_then_they_grow_back() -> None:
    throttled = 0

    def slow(i: int) -> int:
        time.sleep(0.05)  # against the consumer's ~1 ms: Little's law wants the depth
        return i

    p = Prefetcher(range(400), slow, lambda i: 1, depth=16, budget=10**9, pressure=lambda: throttled)
    seen = []
    for i, _ in p:
        time.sleep(0.001)
        if i in (40, 41, 42):  # the store throttles three times in a row
            throttled += 1
        seen.append((p.ceiling, p.target))
    assert seen[39][1] >= 8  # ramped up
    assert seen[43][0] <= 16 / 8 + 0.5 and seen[43][1] <= 2  # 16 -> 8 -> 4 -> 2
    assert seen[-1][0] > seen[43][0] + 3  # additive increase since


def test_a_stream_through_buffer_gives_bytes_as_they_arrive() -> None:
    """A read waits for its own bytes only; a shard that ends early gives fewer; an error
    stops only the reads past what had arrived."""
    from shardkit.storage.streams import Arriving

    buf = Arriving(100, 200)
    buf.write(b"a" * 30)
    assert buf.read_at(10, 110) == b"a" * 10  # the rest has not come yet
    threading.Timer(0.05, lambda: (buf.write(b"b" * 70), buf.finish())).start()
    assert buf.read_at(20, 120) == b"a" * 10 + b"b" * 10  # waited for its bytes
    short = Arriving(0, 10)
    short.write(b"xyz")
    short.finish(end=3)
    assert short.read_at(10, 0) == b"xyz" and short.read_at(4, 5) == b""
    failed = Arriving(0, 10)
    failed.write(b"xyz")
    failed.finish(error=OSError("reset"))
    assert failed.read_at(3, 0) == b"xyz"
    with pytest.raises(OSError, match="reset"):
        failed.read_at(4, 0)


def test_a_read_buffer_is_reused_once_its_writer_and_its_reader_are_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A range's memory goes to the next range only after it is finished and released (a
    writer or a reader could still touch it before), and the next never reads its bytes."""
    from shardkit.storage import streams

    pool = streams.Buffers()
    monkeypatch.setattr(streams, "BUFFERS", pool)
    pool.opening()
    size = 3 << 20
    first = streams.Arriving(0, size)
    mapping = first._buf
    first.write(b"a" * size)
    first.release()  # read, but not finished: a piece may still be written
    assert streams.Arriving(0, size)._buf is not mapping
    first.finish()
    second = streams.Arriving(10, 10 + size)
    assert second._buf is mapping  # the same class (4 MB), taken from the pool
    second.write(b"b" * 5)
    second.finish(end=15)
    assert second.read_at(100, 10) == b"b" * 5  # its own bytes only, not the first range's
    with pytest.raises(RuntimeError, match="released"):  # never another range's bytes, nor a short read
        first.read_at(5, 0)
    never_read = streams.Arriving(0, size)
    never_read.finish(error=OSError("reset"))  # finished, not released: kept by its reader
    assert streams.Arriving(0, size)._buf is not never_read._buf
    pool.closing()  # the last reader closed: nothing kept
    second.release()
    assert streams.Arriving(0, size)._buf is not mapping


def test_a_forked_child_keeps_none_of_its_parents_read_buffers() -> None:
    """A child writing into a mapping its parent kept would copy it page by page (copy on
    write): a child starts with an empty pool."""
    from shardkit.storage import streams

    streams.BUFFERS.opening()
    try:
        held = streams.Arriving(0, 2 << 20)
        held.finish()
        held.release()
        assert streams.BUFFERS._kept
        inherited = storage.RangeReader([])
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 only with an empty pool, and its own reader counted
            empty = streams.BUFFERS._kept == 0 and not streams.BUFFERS._free
            storage.RangeReader([])  # its own, open
            inherited.close()  # the parent's reader: not one of the child's
            os._exit(0 if empty and streams.BUFFERS._readers == 1 else 1)
        assert os.waitpid(pid, 0)[1] == 0
        inherited.close()
    finally:
        streams.BUFFERS.closing()


def test_coalesce_merges_back_to_back_samples_only() -> None:
    shard = np.array([0, 0, 0, 1, 1, 0])
    starts = np.array([0, 10, 20, 0, 10, 40])
    ends = np.array([10, 20, 30, 10, 20, 50])
    plan, range_of = ranges.coalesce(shard, starts, ends, max_bytes=25)
    plan = list(plan)
    assert [(r.shard, r.start, r.stop, r.samples) for r in plan] == [
        (0, 0, 20, 2),
        (0, 20, 30, 1),
        (1, 0, 20, 2),
        (0, 40, 50, 1),
    ]
    assert range_of.tolist() == [0, 0, 1, 2, 2, 3]


def test_blocks_back_to_back_in_the_stream_and_the_shard_are_read_as_one_range() -> None:
    """An unshuffled stream's blocks are merged up to max_bytes (plus a block); blocks that
    are not next to each other in their shard, or read in another order, are not."""
    first = np.array([0, 20, 30])
    offsets = np.concatenate([np.arange(21) * 10, np.arange(11) * 10])  # samples of 10 bytes
    plan, range_of = ranges.blocks(np.arange(30), first, offsets, block=4, max_bytes=100)
    assert [(r.shard, r.start, r.stop, r.samples) for r in plan] == [
        (0, 0, 80, 8),
        (0, 80, 200, 12),
        (1, 0, 100, 10),
    ]  # cut where a block ends past each 100 bytes of the run
    assert range_of.tolist() == [0] * 8 + [1] * 12 + [2] * 10
    ids = np.array([4, 5, 6, 7, 0, 1, 2, 3, 8])  # block 1, then 0, then 2: none merges with the one before
    plan, range_of = ranges.blocks(ids, first, offsets, block=4, max_bytes=1000)
    assert [(r.start, r.stop) for r in plan] == [(40, 80), (0, 40), (80, 120)]  # whole blocks
    assert range_of.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]


def test_blocks_read_each_block_once_in_order_of_need() -> None:
    counts = [10, 7]
    first = np.array([0, 10, 17])
    sizes = np.arange(1, 18) * 3
    all_starts = np.concatenate([np.cumsum(sizes[:10]) - sizes[:10], np.cumsum(sizes[10:]) - sizes[10:]])
    all_ends = all_starts + sizes
    ids = np.array([12, 3, 0, 16, 4, 11])  # blocks of 4: (1,0), (0,0), (0,0), (1,1), (0,1), (1,0)
    offsets = np.concatenate([[0], np.cumsum(sizes[:10]), [0], np.cumsum(sizes[10:])])
    plan, range_of = ranges.blocks(ids, first, offsets, block=4)
    plan = list(plan)
    assert [(r.shard, r.samples) for r in plan] == [(1, 2), (0, 2), (1, 1), (0, 1)]
    assert [(r.start, r.stop) for r in plan] == [
        (all_starts[10], all_ends[13]),
        (all_starts[0], all_ends[3]),
        (all_starts[14], all_ends[16]),
        (all_starts[4], all_ends[7]),
    ]
    assert range_of.tolist() == [0, 1, 1, 2, 3, 0]
    assert sum(counts) == 17
    # the same with block (1,0) needed again 5 samples after its first use: with max_gap 4 it is read again
    plan, range_of = ranges.blocks(ids, first, offsets, block=4, max_gap=4)
    assert [(r.shard, r.start, r.samples) for r in plan] == [
        (1, all_starts[10], 1),
        (0, all_starts[0], 2),
        (1, all_starts[14], 1),
        (0, all_starts[4], 1),
        (1, all_starts[10], 1),
    ]
    assert range_of.tolist() == [0, 1, 1, 2, 3, 4]
    plan, range_of = ranges.blocks(ids, first, offsets, block=4, max_gap=5)  # within the gap: held, read once
    assert range_of.tolist() == [0, 1, 1, 2, 3, 0]


def test_a_part_drawn_again_and_again_is_not_held_whole() -> None:
    ids = np.tile(np.arange(40), 25)  # a 40-sample part drawn 25 times in a stream of 1000
    first, offsets = np.array([0, 40]), np.arange(41) * 100
    plan, range_of = ranges.blocks(ids, first, offsets, block=4, max_gap=4 + 2 * 8)
    plan, uses = list(plan), range_of.tolist()
    last = {r: i for i, r in enumerate(uses)}
    held, peak = set(), 0  # ranges read and not yet done with, as the reader holds them
    for i, r in enumerate(uses):
        held.add(r)
        peak = max(peak, sum(plan[h].size for h in held))
        if last[r] == i:
            held.discard(r)
    assert len(plan) == 250 and peak == 400  # one block at a time, not the whole part


def test_range_cache_round_trip_and_eviction(tmp_path: Path) -> None:
    cache = RangeCache(str(tmp_path / "c"), limit=1000)
    assert cache.get("s3://b/x.tar", "v1", 0, 400) is None
    cache.put("s3://b/x.tar", "v1", 0, 400, b"a" * 400)
    assert cache.get("s3://b/x.tar", "v1", 0, 400) == b"a" * 400
    assert cache.get("s3://b/x.tar", "v2", 0, 400) is None  # the shard changed: a miss
    time.sleep(0.01)
    cache.put("s3://b/x.tar", "v1", 400, 800, b"b" * 400)
    time.sleep(0.01)
    cache.get("s3://b/x.tar", "v1", 0, 400)  # now the most recently used
    cache.put("s3://b/x.tar", "v1", 800, 1200, b"c" * 400)  # over the cap: evict the oldest
    assert cache.get("s3://b/x.tar", "v1", 400, 800) is None
    assert cache.get("s3://b/x.tar", "v1", 0, 400) == b"a" * 400
    names = [p.name for p in (tmp_path / "c").iterdir()]
    assert all("x.tar" not in n and "s3" not in n for n in names)  # hashed names only
    assert sum(size for _, size, _ in RangeCache(str(tmp_path / "c"), limit=1000)._entries()) == 2 * (4 + 400)


@pytest.mark.parametrize("damage", ["flip", "cut", "empty", "headless"])
def test_a_torn_or_damaged_cache_block_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    """A block torn by a power cut (rename does not order the data before it) or damaged on
    disk is never handed out as the shard's bytes."""
    cache = RangeCache(str(tmp_path / "c"), limit=1 << 20)
    cache.put("s3://b/x.tar", "v1", 0, 400, bytes(range(200)) * 2)
    (entry,) = (tmp_path / "c").iterdir()
    raw = bytearray(entry.read_bytes())
    if damage == "flip":
        raw[100] ^= 1
    entry.write_bytes({"flip": bytes(raw), "cut": raw[:300], "empty": b"", "headless": raw[4:]}[damage])
    assert cache.get("s3://b/x.tar", "v1", 0, 400) is None and cache.misses == 1
    assert not entry.exists()
    cache.put("s3://b/x.tar", "v1", 0, 400, bytes(range(200)) * 2)  # downloaded again: served again
    assert cache.get("s3://b/x.tar", "v1", 0, 400) == bytes(range(200)) * 2


def test_range_cache_cap_holds_across_processes_and_killed_writers(tmp_path: Path) -> None:
    """Several processes filling one cache keep it near the cap (each counts the folder as
    it goes, not only its own writes); a killed writer's temporary file is cleared."""
    import multiprocessing

    root = str(tmp_path / "c")
    RangeCache(root, limit=10_000)
    stale = Path(root) / ("x" * 40 + ".blk.tmp-dead")
    stale.write_bytes(b"s" * 3000)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.starmap(_fill, [(root, w) for w in range(4)])
    total = sum(p.stat().st_size for p in Path(root).iterdir())
    assert not stale.exists() and total <= 10_000 * 1.05


def test_range_cache_housekeeping_never_stops_a_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale temporary file that cannot be removed (another user's, in a shared sticky
    folder) is left alone."""
    root = tmp_path / "c"
    RangeCache(str(root), limit=1000)
    stale = root / ("y" * 40 + ".blk.tmp-other")
    stale.write_bytes(b"s" * 10)
    os.utime(stale, (time.time() - 3600, time.time() - 3600))

    def refuse(path: str) -> None:
        raise PermissionError(1, "Operation not permitted", path)

    monkeypatch.setattr(os, "remove", refuse)
    cache = RangeCache(str(root), limit=1000)
    cache.put("s3://b/x.tar", "v1", 0, 2000, b"a" * 2000)  # over the cap: eviction cannot remove either
    assert stale.exists()


def test_throttling_backs_off_from_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    class Throttled(Exception):
        status = 503  # as aiohttp and gcsfs carry it; S3's SlowDown

    slept: list[float] = []
    monkeypatch.setattr(storage.retry.time, "sleep", slept.append)
    monkeypatch.setattr(storage.retry.random, "uniform", lambda low, high: high)  # the longest wait each time
    failures = iter([Throttled("slow down"), Throttled("slow down"), TimeoutError("slow")])

    def get() -> bytes:
        for e in failures:
            raise e
        return b"ok"

    assert storage.retrying("s3://b/x.tar", get) == b"ok"
    assert slept == [1.0, 2.0, 0.8]  # a timeout keeps the short backoff


def test_range_cache_serves_an_entry_it_cannot_touch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a cache shared by several users another user's entry cannot have its time set:
    the hit is served all the same (marking it recently used is best effort)."""
    cache = RangeCache(str(tmp_path / "c"), limit=1000)
    cache.put("s3://b/x.tar", "v1", 0, 5, b"hello")

    def refuse(path: str, *args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "utime", refuse)
    assert cache.get("s3://b/x.tar", "v1", 0, 5) == b"hello"


def _fill(root: str, worker: int) -> None:
    cache = RangeCache(root, limit=10_000)
    for i in range(50):
        cache.put(f"s3://b/{worker}.tar", "v1", i * 200, (i + 1) * 200, b"x" * 200)


def test_retrying_gives_up_with_the_url_named() -> None:
    calls = []

    def flaky() -> bytes:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return b"ok"

    assert storage.retrying("s3://b/x.tar", flaky, base_s=0.001) == b"ok" and len(calls) == 3
    with pytest.raises(
        ShardkitError,
        match=r"^s3://b/y\.tar: TimeoutError: slow \(gave up after 3 attempts; the storage "
        r"options timeout= and attempts= set how long to wait\)$",
    ):
        storage.retrying("s3://b/y.tar", lambda: (_ for _ in ()).throw(TimeoutError("slow")), attempts=3, base_s=0.001)
    with pytest.raises(FileNotFoundError):  # not transient: no retries
        storage.retrying("s3://b/z.tar", lambda: (_ for _ in ()).throw(FileNotFoundError("z")), base_s=10)
    # a client's error that names no URL gets it, on one line, and keeps its type
    with pytest.raises(PermissionError, match=r"^s3://b/p\.tar: Access Denied more$"):
        storage.retrying("s3://b/p.tar", lambda: (_ for _ in ()).throw(PermissionError("Access Denied\nmore")))
    # gcsfs's HTTP 403 is a plain OSError("Forbidden: ..."): permanent too
    with pytest.raises(PermissionError, match=r"^gs://b/q\.tar: Forbidden: q detail$"):
        storage.retrying("gs://b/q.tar", lambda: (_ for _ in ()).throw(OSError("Forbidden: q\ndetail")), base_s=10)
    with pytest.raises(ShardkitError, match=r"^gs://b/r\.tar: OSError: gone \(gave up after gcsfs's own retries\)$"):
        storage.retrying(
            "gs://b/r.tar",
            lambda: (_ for _ in ()).throw(OSError("gone")),
            storage.patience_for("gs://b/r.tar", None).attempts(),
        )
    # a timeout that says nothing (fsspec's FSTimeoutError) says what it was; a 404 that says only its URL, too
    import fsspec.exceptions

    with pytest.raises(ShardkitError, match=r"^s3://b/t\.tar: FSTimeoutError: no answer within the timeout \(gave up"):
        storage.retrying("s3://b/t.tar", lambda: (_ for _ in ()).throw(fsspec.exceptions.FSTimeoutError()), 1)
    with pytest.raises(FileNotFoundError, match=r"^gs://b/n\.tar: not found \(no such object, or no such bucket\)$"):
        storage.retrying(
            "gs://b/n.tar", lambda: (_ for _ in ()).throw(FileNotFoundError("https://x/b/o/n.tar?alt=media"))
        )
    with pytest.raises(FileNotFoundError, match=r"^s3://b/m\.tar \(bytes 0-9\): not found \(no such object, or no"):
        storage.retrying("s3://b/m.tar (bytes 0-9)", lambda: (_ for _ in ()).throw(FileNotFoundError("b/m.tar")))


def test_read_ahead_without_threads_runs_fetches_early_in_place() -> None:
    log: list[str] = []

    def fetch(i: int) -> bytes:
        log.append(f"fetch {i} in {threading.current_thread().name}")
        return b"x"

    for i, _ in Prefetcher(range(6), fetch, lambda i: 1, depth=2, budget=100, threads=False):
        log.append(f"use {i}")
    me = threading.current_thread().name
    assert log[:4] == [f"fetch 0 in {me}", f"fetch 1 in {me}", f"fetch 2 in {me}", "use 0"]
    assert [x for x in log if x.startswith("use")] == [f"use {i}" for i in range(6)]


def test_a_waiting_consumer_doubles_the_reads_in_flight_while_they_bring_more() -> None:
    """Slow start by round trips while the consumer waits for its first range's bytes: each
    round that brought a quarter more bytes a second than the best before doubles the reads
    in flight; a round that did not (the link is full) leaves them as they are."""
    started: list[int] = []
    release = threading.Event()

    def fetch(req: int, hand_over: Any) -> int:
        started.append(req)
        hand_over(req)
        release.wait(10)
        return req

    arrived = [0]
    prefetcher = Prefetcher(
        range(100),
        fetch,
        lambda r: 1,
        depth=32,
        budget=1000,
        streaming=True,
        round_trip=lambda: 0.03,
        arrived=lambda: arrived[0],
    )
    it = iter(prefetcher)
    next(it)  # the first range, alone, taken: the consumer now waits for its bytes
    targets = []
    for brought in (100, 300, 900, 2700, 1000):
        time.sleep(0.04)
        arrived[0] += brought
        prefetcher.stalling()
        targets.append(prefetcher.target)
    assert targets == [2, 4, 8, 16, 16]
    deadline = time.monotonic() + 5
    while len(started) < 16 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(started) == 16  # as many sent as the target allows, at once
    release.set()
    it.close()
