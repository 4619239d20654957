"""The fetch engine (storage/fetch.py): ranges cut into parallel pieces by throughput,
GETs stuck in the latency tail hedged. First its arithmetic and its hedging against a
store of our own making (a `Store` whose answers the test holds back), then against moto
behind the project's proxy: a per-connection bandwidth cap, a latency tail, resets and
throttling together, and a replaced shard, every sample exactly once."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

import fsspec
import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import StreamingDataset
from shardkit.errors import CorruptShardError
from shardkit.storage import RangeReader, fetch
from shardkit.storage.fetch import FetchEngine
from shardkit.storage.stores import Sink, Store
from shardkit.storage.streams import Arriving

from servers.latency_proxy import BURST

MB = 1 << 20


class HeldStore(Store):
    """An object in memory whose GETs wait for the test's word: `hold[n]` is an Event the
    n-th GET waits on before its first byte (none: answered at once)."""

    name = "held"
    conditional = True

    def __init__(self, data: bytes):
        super().__init__()
        self.data, self.hold, self.pins, self.calls = data, {}, [], 0
        self._lock = threading.Lock()

    def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
        with self._lock:
            n, self.calls = self.calls, self.calls + 1
            self.pins.append(pin)
        if n in self.hold:
            assert self.hold[n].wait(10)
        for at in range(start, min(stop, len(self.data)), 64 << 10):
            sink.write(self.data[at : min(at + (64 << 10), stop)])
        return len(self.data)

    def size_now(self, url: str) -> int:
        return len(self.data)

    def cat(self, url: str) -> bytes:
        return self.data

    def open(self, url: str, what: str = "") -> BinaryIO:
        raise NotImplementedError

    def writer(self, url: str) -> Any:
        raise NotImplementedError  # the engine only reads

    def info(self, url: str, what: str = "") -> dict[str, Any]:
        return {"size": len(self.data)}

    def ls(self, url: str, detail: bool) -> list[Any]:
        return []

    def find(self, url: str) -> dict[str, dict[str, Any]]:
        return {}

    def remove(self, url: str) -> None:
        pass

    def makedirs(self, url: str) -> None:
        pass

    def remove_dir(self, url: str) -> None:
        pass


def _seasoned(engine: FetchEngine, first_byte_s: float = 0.001, requests: int = 100) -> FetchEngine:
    """An engine that has seen enough quick GETs to hedge (its p95 under the floor)."""
    engine._seen = fetch._history(HeldStore(b""), "held://x")
    engine._seen.clear()  # the process's history of this store, shared by its engines
    for _ in range(fetch.P95_SEEN):
        engine.first_byte(first_byte_s)
    engine.requests = requests
    return engine


def test_before_anything_is_measured_a_range_is_one_get() -> None:
    engine = FetchEngine(16)
    engine.wanted = lambda: (1e9, 1.0)
    assert engine.bounds(0, 100) == [0, 100]
    assert engine.bounds(0, 64 * MB) == [0, 64 * MB]


def test_pieces_are_as_many_as_the_consumers_rate_needs() -> None:
    """Connections that carry 20 MB/s each, a consumer that takes 90 MB/s and waits for its
    bytes: a 16 MB range in 7 pieces (90 x 1.5 / 20); where one connection carries 200 MB/s,
    one piece; never a piece smaller than a connection's bandwidth-delay product; a consumer
    that does not wait for its bytes gets one piece a range, whatever its rate."""
    engine = FetchEngine(16)
    engine.wanted = lambda: (90e6, 0.9)
    engine.rate, engine.latency_s = 20e6, 0.05
    cuts = engine.bounds(0, 16 * MB)
    assert len(cuts) - 1 == 7 and all(b - a >= MB for a, b in zip(cuts, cuts[1:]))
    engine.rate = 200e6
    assert engine.bounds(0, 16 * MB) == [0, 16 * MB]
    engine.rate, engine.latency_s = 20e6, 0.4  # a BDP of 8 MB: two pieces at most
    assert len(engine.bounds(0, 16 * MB)) - 1 == 2
    engine.wanted = lambda: (1e9, 0.1)
    assert engine.bounds(0, 16 * MB) == [0, 16 * MB]


def test_a_throttling_store_halves_the_pieces_of_a_range() -> None:
    engine = FetchEngine(16)
    engine.wanted = lambda: (1e9, 1.0)
    engine.rate, engine.latency_s = 10e6, 0.01
    assert len(engine.bounds(0, 64 * MB, pressure=0)) - 1 == 16
    assert len(engine.bounds(0, 64 * MB, pressure=1)) - 1 == 8
    assert len(engine.bounds(0, 64 * MB, pressure=2)) - 1 == 4
    assert len(engine.bounds(0, 64 * MB, pressure=2)) - 1 == 5  # a range without: one more


def _fill(
    engine: FetchEngine, store: Store, data: bytes, pin: dict[str, Any] | None = None, read: bool = True
) -> Arriving:
    """`data` fetched into a buffer by `engine`, `read` by a reader waiting for its bytes
    meanwhile (as a worker does once it comes to the range), or not (read-ahead, ahead)."""
    into = Arriving(0, len(data))

    def run() -> None:
        try:
            engine.run(
                into.split(engine.bounds(0, len(data))),
                lambda piece: engine.get(store, "held://x", piece, pin) and None,
            )
            into.finish(end=into.filled)
        except BaseException as e:  # noqa: BLE001 - the reader raises it
            into.finish(error=e)

    fetching = threading.Thread(target=run)
    fetching.start()
    if read:
        assert into.read_at(len(data), 0) == data
    fetching.join(10)
    return into


def test_a_late_first_byte_is_hedged_and_the_first_answer_wins() -> None:
    data = bytes(range(256)) * 4096  # 1 MB
    store = HeldStore(data)
    late = store.hold[0] = threading.Event()  # the first GET's answer is held back
    engine = _seasoned(FetchEngine(4))
    into = _fill(engine, store, data, pin={"etag": '"v1"'})
    assert into.data() == data  # the hedge's bytes, once
    assert (engine.hedges, engine.hedge_wins, store.calls) == (1, 1, 2)
    assert store.pins == [{"etag": '"v1"'}] * 2  # the hedge reads the pinned version too
    late.set()  # the first GET answers at last: it stops unread, and writes nothing
    time.sleep(0.05)
    assert into.data() == data
    engine.close()


def test_a_late_get_of_read_ahead_is_hedged_once_its_reader_waits() -> None:
    """Read-ahead's GET late while no reader needs its bytes yet: no hedge (the share is kept
    for GETs that hold a reader up); once its reader comes to wait for it, hedged at once."""
    data = b"r" * MB
    store = HeldStore(data)
    late = store.hold[0] = threading.Event()
    engine = _seasoned(FetchEngine(4))
    into = Arriving(0, len(data))
    fetching = threading.Thread(target=lambda: engine.get(store, "held://x", into.pieces[0], None))
    fetching.start()
    time.sleep(0.3)  # six times the bar: read-ahead, late, with nobody waiting
    assert (engine.hedges, store.calls) == (0, 1)
    assert into.read_at(len(data), 0) == data  # the reader comes: the hedge answers it
    assert (engine.hedges, engine.hedge_wins, store.calls) == (1, 1, 2)
    late.set()
    fetching.join(10)
    engine.close()


def test_a_get_sent_before_any_latency_was_seen_is_hedged_once_one_is() -> None:
    """No history when the GET went out (a fresh process's first): no bar then; the bar is
    read anew while it waits, so once quick answers have been seen it is hedged."""
    data = b"f" * MB
    store = HeldStore(data)
    late = store.hold[0] = threading.Event()
    engine = _seasoned(FetchEngine(4))
    engine._seen.clear()
    into = Arriving(0, len(data))
    fetching = threading.Thread(target=lambda: engine.get(store, "held://x", into.pieces[0], None))
    fetching.start()
    reading = threading.Thread(target=into.read_at, args=(len(data), 0))
    reading.start()
    time.sleep(0.2)
    assert (engine.hedges, store.calls) == (0, 1)  # nothing seen: nothing to hedge by
    for _ in range(fetch.P95_SEEN):
        engine.first_byte(0.001)
    reading.join(5)
    assert (engine.hedges, engine.hedge_wins, store.calls) == (1, 1, 2) and into.data() == data
    late.set()
    fetching.join(10)
    engine.close()


def test_a_hedge_in_the_tail_too_gets_one_more() -> None:
    """The GET and its hedge both late: a third attempt answers, and no more are sent."""
    data = b"t" * MB
    store = HeldStore(data)
    late = store.hold[0] = store.hold[1] = threading.Event()
    engine = _seasoned(FetchEngine(4))
    into = _fill(engine, store, data)
    assert into.data() == data
    assert (engine.hedges, engine.hedge_wins, store.calls) == (2, 1, fetch.ATTEMPTS)
    late.set()
    engine.close()


def test_a_small_read_is_hedged_and_counted() -> None:
    """fetch.first_answer: a whole small read with no answer after the bar is sent again; the
    first answer wins, counted in opening_counts(); an error only once all attempts failed."""
    _seasoned(FetchEngine(4), first_byte_s=0.01).close()  # the process has seen quick answers of the store
    store = HeldStore(b"")
    held, calls = threading.Event(), []

    def call() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            held.wait(10)
            return b"late"
        return b"hedge"

    before = fetch.opening_counts()
    assert fetch.first_answer(store, "held://x", call) == b"hedge"  # the first is held until the end
    after = fetch.opening_counts()
    assert (after["hedges"] - before["hedges"], after["hedge_wins"] - before["hedge_wins"]) == (1, 1)
    held.set()

    def fails() -> bytes:
        raise OSError("refused")

    with pytest.raises(OSError, match="refused"):
        fetch.first_answer(store, "held://x", fails)


def test_a_first_answer_in_time_is_not_hedged() -> None:
    data = b"x" * MB
    store = HeldStore(data)
    engine = _seasoned(FetchEngine(4))
    for _ in range(5):
        assert _fill(engine, store, data).data() == data
    assert engine.hedges == 0 and store.calls == 5
    engine.close()


def test_hedges_stay_within_their_share_of_requests() -> None:
    """Every GET late: hedges stop at HEDGE_SHARE of the requests (and HEDGE_BURST)."""
    data = b"y" * 4096
    store = HeldStore(data)
    engine = _seasoned(FetchEngine(4), requests=0)
    release = threading.Event()
    for n in range(0, 400, 1):
        store.hold[n] = release
    threads = [threading.Thread(target=_fill, args=(engine, store, data)) for _ in range(60)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # past every hedge's time
    release.set()
    for t in threads:
        t.join(10)
    assert 0 < engine.hedges <= fetch.HEDGE_SHARE * engine.requests + fetch.HEDGE_BURST
    engine.close()


def test_the_hedge_bar_from_the_first_latency_seen() -> None:
    """Nothing seen: no hedge. A few seen: 4x their median (a short epoch's few GETs are
    hedged too). Enough seen: their p95, but no more than 4x their median; the floor always."""
    engine = FetchEngine(4)
    engine._seen = fetch._history(HeldStore(b""), "held://x")
    engine._seen.clear()
    engine.requests = 1
    assert engine.hedge_after() is None
    for seconds in (0.1, 0.3, 0.2):
        engine.first_byte(seconds)
    assert engine.hedge_after() == pytest.approx(0.8)
    engine._seen.extend([0.1] * 20 + [0.5])
    assert engine.hedge_after() == pytest.approx(0.2)  # the p95
    engine._seen.extend([2.0] * 3)
    assert engine.hedge_after() == pytest.approx(0.4)  # 4x the median: the tail sets no bar inside itself
    engine._seen.clear()
    engine.first_byte(0.001)
    assert engine.hedge_after() == fetch.HEDGE_FLOOR_S
    engine._seen.clear()


def test_a_datasets_index_read_times_its_workers_first_hedges(s3: dict, packed: Path) -> None:
    """The index's read is a first-byte latency of its store: a DataLoader worker forked after
    it hedges its first GET, not only after it has timed GETs of its own."""
    from shardkit.storage import latencies

    url = f"{s3['url']}/seeded"
    fs, root = fsspec.core.url_to_fs(url, **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    where = s3["storage_options"]["client_kwargs"]["endpoint_url"]
    latencies.history("s3 (presigned)", where).clear()
    ds = StreamingDataset(url, storage_options=s3["storage_options"])
    assert len(latencies.history(ds.store_name(), where)) == 1
    engine = FetchEngine(4)
    engine._seen, engine.requests = latencies.history(ds.store_name(), where), 1
    assert engine.hedge_after() is not None


def test_a_failing_first_get_waits_for_a_hedge_that_answered() -> None:
    """The first GET fails after its hedge has claimed the piece: the hedge's bytes stand."""

    class FailsLate(HeldStore):
        def get(self, url: str, start: int, stop: int, sink: Sink, pin: dict[str, Any] | None) -> int | None:
            with self._lock:
                n, self.calls = self.calls, self.calls + 1
            if n == 0:
                time.sleep(0.3)
                raise ConnectionResetError("reset before its first byte")
            return super().get(url, start, stop, sink, pin)

    data = b"z" * MB
    engine = _seasoned(FetchEngine(4))
    assert _fill(engine, FailsLate(data), data).data() == data
    assert engine.hedge_wins == 1
    engine.close()


# Against moto behind the proxy


@pytest.fixture
def bulky(tmp_path: Path, photos: Path) -> Path:
    """A dataset of large samples: 30 photos padded to ~96 KB each, in one shard."""
    from PIL import Image

    big = tmp_path / "bulky"
    for path in sorted(photos.rglob("*.jpg")):
        target = big / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        img = Image.open(path).resize((640, 480))
        img.save(target, quality=100)
    return big


def _upload(s3: dict, folder: Path, name: str) -> str:
    url = f"{s3['url']}/{name}"
    shardkit.pack(str(folder), url, workers=1, progress=False, storage_options=s3["storage_options"])
    return url


def test_a_connection_capped_store_is_read_over_parallel_pieces(
    s3: dict,
    s3_server: str,
    bulky: Path,
    latency_proxy,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    """1 MB/s a connection: a first range in one GET, which measures about the cap; then, for a
    consumer waiting for its bytes, a range is cut into pieces read over several connections at
    once; the bytes are the shard's, exactly."""
    monkeypatch.setattr(fetch, "MIN_PIECE", 64 << 10)
    url = _upload(s3, bulky, "capped")
    idx = shardkit.index.load(url, s3["storage_options"])
    shard = idx.shards[0]
    proxied, control = latency_proxy(s3_server, latency_ms=5, conn_mbps=1)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    reader = RangeReader([f"{url}/{shard.name}"], opts, pins=[shard.version], connections=8)
    expected = fsspec.filesystem("s3", **s3["storage_options"]).cat_file(f"{url}/{shard.name}".removeprefix("s3://"))
    size = min(len(expected), 1 << 20)
    try:
        before = control.stats()["requests"]
        started = time.perf_counter()
        assert reader.read(0, 0, size) == expected[:size]
        took = time.perf_counter() - started
        assert control.stats()["requests"] - before == 1  # measured nothing yet: one GET
        assert took >= 0.9 * size / 1e6  # at 1 MB/s at most
        assert 0.2e6 < reader.engine.rate < 5e6  # what a connection carries, measured
        reader.engine.wanted = lambda: (4e6, 0.9)  # a consumer taking 4 MB/s, waiting: 6 connections at 1 MB/s
        before = control.stats()["requests"]
        started = time.perf_counter()
        assert reader.read(0, 0, size) == expected[:size]
        took, pieces = time.perf_counter() - started, control.stats()["requests"] - before
        assert pieces >= 4  # on several connections at once
        assert took >= 0.9 * (size / pieces - BURST) / 1e6  # each at 1 MB/s at most, after its bucket's burst
    finally:
        reader.close()


def _behind_a_tail(
    s3: dict,
    s3_server: str,
    packed: Path,
    latency_proxy,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
    name: str,
    seed: int,
) -> tuple[str, dict, Any]:
    """`packed` uploaded as `name`, read through a proxy holding a fifth of the first bytes
    1.5 s, hedging up to half of them: (url, storage options, control)."""
    monkeypatch.setattr(fetch, "HEDGE_SHARE", 0.5)
    url = f"{s3['url']}/{name}"
    fs, root = fsspec.core.url_to_fs(url, **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(s3_server, latency_ms=5, tail_prob=0.2, tail_ms=1500, seed=seed)
    return url, {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}, control


def test_hedges_beat_the_latency_tail_and_lose_no_sample(
    s3: dict,
    s3_server: str,
    packed: Path,
    latency_proxy,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fifth of the first bytes held 1.5 s: hedged GETs answer first, counted in stats(),
    every sample exactly once."""
    url, opts, control = _behind_a_tail(s3, s3_server, packed, latency_proxy, monkeypatch, "tail", 5)
    ds = StreamingDataset(url, storage_options=opts, shuffle=True, block=2, prefetch=2)
    got = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    stats = ds.stats()
    assert control.stats()["tailed"] > 0
    assert stats["hedges"] > 0 and 0 < stats["hedge_wins"] <= stats["hedges"]
    # the share, a burst a worker, and the open's two small reads (index, offsets file)
    assert stats["hedges"] <= 0.5 * stats["requests"] + 2 * fetch.HEDGE_BURST + 2 * (fetch.ATTEMPTS - 1)
    assert stats["store"] == "s3 (presigned)"


def test_a_datasets_open_is_hedged_against_the_tail(
    s3: dict,
    s3_server: str,
    packed: Path,
    latency_proxy,  # type: ignore[no-untyped-def]
) -> None:
    """index.json's first answer held 20 s: a fresh process (no latency seen) sends it again
    after FIRST_HEDGE_S; the dataset opens in about that, the hedge counted in stats()."""
    from shardkit.storage import latencies

    url = f"{s3['url']}/open-tail"
    fs, root = fsspec.core.url_to_fs(url, **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(s3_server, tail_prob=1.0, tail_ms=20_000)
    latencies.history("s3 (presigned)", proxied).clear()
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    opened: list[StreamingDataset] = []
    started = time.perf_counter()
    opening = threading.Thread(target=lambda: opened.append(StreamingDataset(url, storage_options=opts)))
    opening.start()
    while not control.stats()["tailed"]:  # the index's first answer is in the tail: the rest not
        time.sleep(0.005)
    control.set("tail_prob", 0)
    opening.join(10)
    took = time.perf_counter() - started
    assert opened and took < 5, took
    assert len(list(opened[0])) == 120
    stats = opened[0].stats()
    assert stats["hedges"] >= 1 and stats["hedge_wins"] >= 1


def test_resets_throttling_and_hedges_together_cost_no_sample(
    s3: dict,
    s3_server: str,
    packed: Path,  # type: ignore[no-untyped-def]
    latency_proxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shardkit.storage.patience, "OUTAGE_RETRIES", 10)
    url, opts, control = _behind_a_tail(s3, s3_server, packed, latency_proxy, monkeypatch, "storm", 11)
    ds = StreamingDataset(url, storage_options=opts, shuffle=True, block=3)
    control.set("reset_prob", 0.15)
    control.set("reset_max_bytes", 2_000)
    control.storm(600, 0.15)
    got = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    stats = control.stats()
    assert stats["throttled"] > 0 and stats["resets"] > 0 and stats["tailed"] > 0


def test_every_throttled_answer_is_counted_hedges_included(
    s3: dict,
    s3_server: str,
    packed: Path,
    latency_proxy,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hedge the store throttles, or a GET throttled after its hedge answered, is no
    request that anything retries: its 503 is counted all the same, so `stats()` says as
    many as the store gave (one went uncounted in a benchmark's fault run)."""
    monkeypatch.setattr(shardkit.storage.patience, "OUTAGE_RETRIES", 10)  # a storm of a quarter: no give-up
    url, opts, control = _behind_a_tail(s3, s3_server, packed, latency_proxy, monkeypatch, "counted", 13)
    ds = StreamingDataset(url, storage_options=opts, shuffle=True, block=3)
    control.storm(600, 0.25)  # after the opening: its reads' hedges may still retry as the epoch ends
    got = [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=2)]
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    stats = ds.stats()
    assert stats["hedges"] > 0 and stats["throttled"] == control.stats()["throttled"] > 0


def test_a_replaced_shard_is_caught_under_hedging(
    s3: dict,
    s3_server: str,
    photos: Path,
    latency_proxy,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fetch, "HEDGE_SHARE", 1.0)
    url = s3["url"] + "/replaced"
    shardkit.pack(str(photos), url, max_count=10, workers=1, progress=False, storage_options=s3["storage_options"])
    fs = fsspec.filesystem("s3", **s3["storage_options"])
    root = url.removeprefix("s3://")
    fs.pipe(f"{root}/shard-000001.tar", fs.cat_file(f"{root}/shard-000000.tar"))
    proxied, _ = latency_proxy(s3_server, latency_ms=5, tail_prob=0.5, tail_ms=1000, seed=2)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    ds = StreamingDataset(url, storage_options=opts)
    with pytest.raises(CorruptShardError, match=r"shard-000001\.tar: changed since its index was made"):
        list(ds)


@pytest.mark.parametrize(
    ("chosen", "presigned_parts"),
    [
        ({}, True),
        ({"client": "s3fs"}, False),
        ({"config_kwargs": {"request_checksum_calculation": "when_supported"}}, False),  # botocore's CRC32s
    ],
)
def test_an_upload_sends_its_parts_in_parallel(
    s3: dict,
    s3_server: str,
    latency_proxy,  # type: ignore[no-untyped-def]
    chosen: dict,
    presigned_parts: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """24 MB into a bucket behind 4 MB/s a connection: its parts go up on several
    connections at once (presigned PUTs from the parts' buffers, or s3fs's client where it
    reads, or where checksums are asked for), the object is the bytes written, and an
    upload that fails leaves nothing under its name."""
    import os

    from shardkit.storage import atomic_writer, s3_http
    from shardkit.storage.stores import s3 as s3_store

    presigned: list[int] = []
    put_part = s3_http.Direct.put_part
    monkeypatch.setattr(s3_http.Direct, "put_part", lambda self, *a: presigned.append(a[2]) or put_part(self, *a))
    proxied, control = latency_proxy(s3_server, latency_ms=5, conn_mbps=4)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}, **chosen}
    data = os.urandom(3 * s3_store.PART)
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], control.stats()["active"])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with atomic_writer(s3["url"] + "/big.bin", opts) as f:
            for at in range(0, len(data), 1 << 20):
                f.write(data[at : at + (1 << 20)])
    finally:
        stop.set()
        watcher.join()
    fs = fsspec.filesystem("s3", **s3["storage_options"])
    assert fs.cat_file(s3["url"].removeprefix("s3://") + "/big.bin") == data
    assert peak[0] >= 2  # parts on several connections at once
    assert sorted(presigned) == ([1, 2, 3] if presigned_parts else [])
    with pytest.raises(RuntimeError), atomic_writer(s3["url"] + "/broken.bin", opts) as f:
        f.write(data[: 2 * s3_store.PART])
        raise RuntimeError("the writer fails")
    assert not fs.exists(s3["url"].removeprefix("s3://") + "/broken.bin")


def test_presigned_parts_cut_by_resets_are_sent_again_whole(s3: dict, s3_server: str, latency_proxy) -> None:  # type: ignore[no-untyped-def]
    """A part PUT whose answer is reset is sent again (an idempotent request) from its kept
    buffer: the object is the bytes written, each once; so is the next upload, whose parts
    are written into the buffers the first one's gave back."""
    import os

    from shardkit.storage import atomic_writer
    from shardkit.storage.stores import s3 as s3_store

    proxied, control = latency_proxy(s3_server, latency_ms=2, seed=3)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    fs = fsspec.filesystem("s3", **s3["storage_options"])
    data = os.urandom(3 * s3_store.PART + 12345)
    control.set("reset_prob", 0.3)
    for name in ("a.bin", "b.bin"):
        with atomic_writer(f"{s3['url']}/{name}", opts) as f:
            for at in range(0, len(data), 3 << 20):
                f.write(data[at : at + (3 << 20)])
        assert fs.cat_file(f"{s3['url'].removeprefix('s3://')}/{name}") == data
    assert control.stats()["resets"] > 0


def test_a_ranged_read_cut_short_is_read_again_whole(s3: dict, s3_server: str, latency_proxy) -> None:  # type: ignore[no-untyped-def]
    """storage.read_range (a pack's read of an image in a bucket) retried after a body cut
    short asks for the whole range again into a buffer of its own: the bytes, not the
    range's start again after what came."""
    import os

    data = os.urandom(1 << 20)
    fs = fsspec.filesystem("s3", **s3["storage_options"])
    fs.pipe(s3["url"].removeprefix("s3://") + "/image.jpg", data)
    proxied, control = latency_proxy(s3_server, seed=5, conn_mbps=5)  # paced: bytes come before the RST
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    control.set("reset_prob", 0.3)
    control.set("reset_max_bytes", 800_000)  # past a first 256-KB read
    for start, stop in ((0, len(data)), (1000, 900_000)) * 4:
        assert shardkit.storage.read_range(s3["url"] + "/image.jpg", start, stop, opts) == data[start:stop]
    assert control.stats()["resets"] > 0


def test_a_part_refused_early_fails_with_its_status(seaweedfs: dict) -> None:
    """A part's PUT for an upload the store does not know fails with the store's answer (404
    NoSuchUpload), at once: not retried, nor taken for a reset. (A server that answers before
    the body is in and closes, as S3 may, is read the same way, `s3_http._early_answer`;
    SeaweedFS here reads the 8 MB first.)"""
    import os

    from shardkit.storage import s3_http
    from shardkit.storage.stores import s3 as s3_store

    direct = s3_http.direct(seaweedfs["storage_options"])
    assert direct is not None
    path = seaweedfs["url"].removeprefix("s3://") + "/never-begun.bin"
    with pytest.raises(s3_http.HTTPStatusError) as refused:
        direct.put_part(path, "no-such-upload", 1, memoryview(os.urandom(s3_store.PART)))
    assert refused.value.status == 404


def test_a_packs_processes_share_one_budget_of_parts_in_flight(s3: dict) -> None:
    """A pack's pool tells each process how many share the uploads (executors.init_worker):
    each upload then keeps PARTS_IN_FLIGHT / processes parts in flight (2 to UPLOADS), so
    that 8 processes a core hold no more memory in parts than 8 did."""
    from shardkit.storage import filesystem, share_uploads
    from shardkit.storage.stores import s3 as s3_store

    fs, path = filesystem(s3["url"] + "/x.bin", s3["storage_options"])
    try:
        for processes, parts in ((1, s3_store.UPLOADS), (16, 4), (64, 2)):
            share_uploads(processes)
            upload = s3_store.MultipartUpload(fs, path)
            assert upload._uploads == parts and upload._uploads * processes <= max(
                s3_store.PARTS_IN_FLIGHT, 2 * processes
            )
            upload.abort()
    finally:
        share_uploads(1)


def test_puts_send_their_bodies_without_waiting_for_a_go_ahead(
    s3: dict,
    s3_server: str,
    latency_proxy,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """No `Expect: 100-continue` (botocore's default for a body): a small PUT and each part
    of an upload send their bytes with their headers, one round trip each, not two. Through
    the proxy's trace, which logs what a client sends after an answer began as a request
    of its own: a body sent after a go-ahead would be logged as a line that is no request."""
    import json

    from shardkit.storage import atomic_writer, write_bytes_atomic
    from shardkit.storage.stores import s3 as s3_store

    proxied, control = latency_proxy(s3_server, latency_ms=5)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    trace = tmp_path / "trace.jsonl"
    control.send(f"trace {trace}")
    for i in range(4):
        write_bytes_atomic(f"{s3['url']}/small-{i}.json", b"{}", opts)
    with atomic_writer(s3["url"] + "/parts.bin", opts) as f:
        f.write(b"x" * (2 * s3_store.PART + 1))
    write_bytes_atomic(f"{s3['url']}/last.json", b"{}", opts)
    control.reset_all()  # every connection ends: the last request of each is written (while tracing)

    def lines() -> list[str]:
        return [json.loads(row)["line"] for row in trace.read_text().splitlines()] if trace.exists() else []

    deadline = time.monotonic() + 30  # 5 small PUTs and 3 parts, each written once its connection ended
    while sum(line.startswith("PUT ") for line in lines()) < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    control.send("trace off")
    assert sum(line.startswith("PUT ") for line in lines()) >= 8, lines()
    assert all(line.split(" ", 1)[0] in {"GET", "HEAD", "PUT", "POST", "DELETE"} for line in lines()), lines()


def test_a_pack_into_a_fresh_bucket_prefix_removes_no_record_before_its_shards(
    s3: dict,
    s3_server: str,
    latency_proxy,
    photos: Path,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """A DEST that held no progress records: its jobs skip removing an earlier record (a round
    trip before each shard), nothing lists them before the index, and after it only the
    progress folder is listed, not DEST (there is nothing else of shardkit's to find)."""
    import json

    proxied, control = latency_proxy(s3_server)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    trace = tmp_path / "trace.jsonl"
    control.send(f"trace {trace}")
    idx = shardkit.pack(
        str(photos), s3["url"] + "/fresh", max_count=10, workers=2, progress=False, storage_options=opts
    )
    control.reset_all()
    deadline = time.monotonic() + 30
    while not (trace.exists() and "DELETE /shardkit-test/fresh/.shardkit-lock" in trace.read_text()):
        assert time.monotonic() < deadline, "the trace written"
        time.sleep(0.05)
    control.send("trace off")
    lines = [json.loads(row)["line"] for row in trace.read_text().splitlines()]
    index_put = next(i for i, line in enumerate(lines) if line.startswith("PUT /shardkit-test/fresh/index.json"))
    removed = [i for i, line in enumerate(lines) if line.startswith("DELETE /shardkit-test/fresh/.shardkit-progress/")]
    assert len(idx.shards) == 3 and removed and min(removed) > index_put, lines
    listed = [line for line in lines if "list-type=2" in line and "max-keys=1" not in line]
    assert len(listed) == 3, listed  # DEST's before the pack, the pins', the progress folder's after the index
    assert sum(line.startswith("DELETE /shardkit-test/fresh/.shardkit-progress/shard-") for line in lines) == 6


def test_each_web_server_keeps_a_latency_history_of_its_own() -> None:
    """Hedges are timed by the latencies of the host a GET goes to: two web servers are two
    stores; an S3 or GCS dataset's is its endpoint's."""
    from shardkit.storage.clients import origin

    assert origin("https://a.example/ds/x.tar", None) == "https://a.example"
    assert origin("https://a.example/ds/x.tar", None) != origin("http://127.0.0.1:8000/x.tar", None)
    assert origin("s3://b/x.tar", {"client_kwargs": {"endpoint_url": "http://h:9000"}}) == "http://h:9000"
    assert origin("s3://b/x.tar", None) == ""  # AWS's own endpoints
