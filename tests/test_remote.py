"""Remote storage against real servers on loopback: moto's S3 server, the GCS emulator and
a WebHDFS server (tests/servers/ starts them). Nothing here mocks a storage client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import StreamingDataset
from shardkit.errors import CorruptShardError, ShardkitError

from test_pack import read_shards


def keys(ds: StreamingDataset, workers: int = 0) -> list[str]:
    return [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=workers)]


def test_pack_to_remote_then_stream_it(remote: dict, photos: Path, tmp_path: Path) -> None:
    url, opts = remote["url"] + "/ds", remote["storage_options"]
    local = shardkit.pack(str(photos), str(tmp_path / "local"), max_count=7, workers=1, progress=False)
    idx = shardkit.pack(str(photos), url, max_count=7, workers=2, progress=False, storage_options=opts)
    # the same bytes, wherever they go; a store's shards carry its versions, local ones their fingerprints
    unpinned = [replace(i, shards=tuple(replace(s, version=None) for s in i.shards)).to_json() for i in (idx, local)]
    assert unpinned[0] == unpinned[1]
    assert all(s.version and "fingerprint" not in s.version for s in idx.shards)
    assert all(s.version and list(s.version) == ["fingerprint"] for s in local.shards)
    assert shardkit.verify(url, opts) == []
    assert sorted(shardkit.storage.listdir(url, opts)) == sorted(
        ["index.json", idx.offsets_file.file, *(s.name for s in idx.shards)]
    )
    expected = read_shards(tmp_path / "local")
    ds = StreamingDataset(url, storage_options=opts, prefetch=4)
    got = {s["__key__"]: s for s in ds}
    assert sorted(got) == sorted(expected)
    for key, fields in expected.items():
        assert got[key]["jpg"] == fields["jpg"]
        assert got[key]["cls"] == int(fields["cls"])


def test_a_remote_sidecar_is_copied_once_and_checked(s3: dict, photos: Path, tmp_path: Path) -> None:
    """The offsets file of a remote dataset: one download per machine (every rank and
    dataset after the first maps the same copy), checked against index.json's sha256."""
    import fsspec.core

    url, opts = s3["url"] + "/side", s3["storage_options"]
    idx = shardkit.pack(str(photos), url, max_count=7, workers=1, progress=False, storage_options=opts)
    cache = tmp_path / "cache"
    first = StreamingDataset(url, storage_options=opts, cache_dir=str(cache))
    (copy,) = (cache / "offsets").glob("*.npy")
    made = copy.stat().st_mtime_ns
    second = StreamingDataset(url, storage_options=opts, cache_dir=str(cache), shuffle=True)
    assert copy.stat().st_mtime_ns == made and first._samples._table.path == second._samples._table.path == str(copy)
    assert len(keys(second, workers=2)) == 30
    fs, root = fsspec.core.url_to_fs(url, **opts)
    data = bytearray(fs.cat_file(f"{root}/{idx.offsets_file.file}"))
    data[-8:] = bytes(8)
    fs.pipe_file(f"{root}/{idx.offsets_file.file}", bytes(data))
    with pytest.raises(CorruptShardError, match=rf"{idx.offsets_file.file}: sha256 mismatch with index.json"):
        StreamingDataset(url, storage_options=opts, cache_dir=str(tmp_path / "other"))


def test_cli_on_s3(s3: dict, photos: Path) -> None:
    endpoint = s3["storage_options"]["client_kwargs"]["endpoint_url"]
    opts = ["-o", "key=testing", "-o", "secret=testing", "-o", f"endpoint_url={endpoint}"]
    url = s3["url"] + "/cli"

    def run(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shardkit.cli", *a, *opts], capture_output=True, text=True)

    assert run("pack", str(photos), url, "--max-count", "10", "-q").returncode == 0
    info = run("info", url, "--json")
    assert json.loads(info.stdout)["samples"] == 30
    assert "testing" not in info.stdout + info.stderr  # no credentials in the output
    assert run("verify", url, "-q").returncode == 0


def test_rerun_after_an_interrupted_upload(s3: dict, photos: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fsspec.core

    url, opts = s3["url"] + "/crash", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    shardkit.pack(str(photos), url + "-clean", max_count=4, workers=2, progress=False, storage_options=opts)
    clean = {p.rpartition("/")[2]: fs.cat_file(p) for p in fs.find(root + "-clean")}
    with monkeypatch.context() as m:  # the crash came before the commit...
        m.setattr(shardkit.index, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
        with pytest.raises(RuntimeError):
            shardkit.pack(str(photos), url, max_count=4, workers=2, progress=False, storage_options=opts)
    with pytest.raises(shardkit.UnfinishedPackError):  # the bucket shows the pack unfinished, not as shards to read
        StreamingDataset(url, storage_options=opts)
    fs.rm_file(f"{root}/shard-000003.tar")  # ...with one shard never uploaded
    fs.rm_file(f"{root}/.shardkit-progress/shard-000003.tar.json")
    shardkit.pack(str(photos), url, max_count=4, workers=2, progress=False, storage_options=opts)
    fs.invalidate_cache()
    assert {p.rpartition("/")[2]: fs.cat_file(p) for p in fs.find(root)} == clean


def test_an_overwrite_in_a_bucket_is_never_read_half_done(
    s3: dict, photos: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, opts = s3["url"] + "/overwrite", s3["storage_options"]
    shardkit.pack(str(photos), url, max_count=4, workers=1, progress=False, storage_options=opts)
    write = shardkit.storage.atomic_writer

    def die_after_the_first_shard(target: str, *args: object):  # type: ignore[no-untyped-def]
        if target.endswith("shard-000001.tar"):
            raise RuntimeError("killed")
        return write(target, *args)

    with monkeypatch.context() as m:
        m.setattr(shardkit.storage, "atomic_writer", die_after_the_first_shard)
        with pytest.raises(RuntimeError):
            shardkit.pack(
                str(photos), url, max_count=4, seed=1, workers=1, progress=False, storage_options=opts, overwrite=True
            )
    with pytest.raises(shardkit.UnfinishedPackError):  # seed 1's first shard beside seed 0's others: not a dataset
        StreamingDataset(url, storage_options=opts)


def test_a_local_tree_and_its_copy_in_a_bucket_scan_alike(s3: dict, tmp_path: Path) -> None:
    import fsspec.core

    from shardkit.packing.inputs.folder import scan_folder

    tree = tmp_path / "tree"
    for rel in (
        "a/x.jpg",
        "a/x-2.jpg",
        "a/x/1.jpg",
        "a-b/z.jpg",
        "b/readme.txt",
        "c/y.jpg",
    ):  # "a-b/" lists before "a/"
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes(b"data")
    url, opts = s3["url"] + "/tree", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(tree) + "/", root, recursive=True)
    local, remote = scan_folder(str(tree)), scan_folder(url, opts)
    assert local[0] == remote[0] == ("a", "a-b", "b", "c")  # a class folder without images is a class in both

    def items(listing):  # type: ignore[no-untyped-def]
        return [(listing.item(i).path, listing.item(i).label) for i in range(len(listing))]

    assert (
        items(local[1])
        == items(remote[1])
        == [("a/x-2.jpg", 0), ("a/x.jpg", 0), ("a/x/1.jpg", 0), ("a-b/z.jpg", 1), ("c/y.jpg", 3)]
    )


def test_workers_cache_and_second_epoch_from_disk(s3: dict, packed: Path, tmp_path: Path) -> None:
    import fsspec.core

    url, opts = s3["url"] + "/ds", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    ds = StreamingDataset(
        url,
        storage_options=opts,
        shuffle=True,
        cache_dir=str(tmp_path / "cache"),
        cache_limit="1GB",
        prefetch_bytes="64MB",
        block=8,
    )
    first = keys(ds, workers=2)
    after_first = ds.stats()
    second = keys(ds, workers=2)
    after_second = ds.stats()
    assert sorted(first) == sorted(second) and len(set(first)) == 120 and first != second
    assert after_first["fetched_bytes"] > 0 and after_first["cache_hits"] == 0
    assert after_second["fetched_bytes"] == after_first["fetched_bytes"]  # epoch 2: nothing downloaded
    assert after_second["cache_hits"] > 0
    names = [p.name for p in (tmp_path / "cache" / "blocks").iterdir()]
    assert names and all("shardkit-test" not in n and "testing" not in n for n in names)
    block = tmp_path / "cache" / "blocks" / names[0]  # a block damaged on disk: fetched again, never handed out
    damaged = bytearray(block.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    block.write_bytes(damaged)
    assert {s["__key__"]: s["jpg"] for s in ds} == {s["__key__"]: s["jpg"] for s in StreamingDataset(str(packed))}
    assert ds.stats()["fetched_bytes"] > after_second["fetched_bytes"]


def test_read_buffers_reused_range_after_range_give_every_sample_its_own_bytes(
    s3: dict, packed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streamed ranges' memory goes from range to range (streams.Buffers: here every range
    pooled, however small); samples come out as a local read gives them."""
    import fsspec.core

    from shardkit.storage import streams

    url, opts = s3["url"] + "/pooled", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    monkeypatch.setattr(streams.Buffers, "POOLED", 1)
    taken: list[Any] = []  # held, so that no two mappings are told apart by a reused id()
    take = streams.BUFFERS.take
    monkeypatch.setattr(streams.BUFFERS, "take", lambda size: taken.append(take(size)) or taken[-1])
    ds = StreamingDataset(url, storage_options=opts, block=4, prefetch_bytes="64KB")
    got = [(s["__key__"], s["jpg"]) for s in ds]
    assert got == [(s["__key__"], s["jpg"]) for s in StreamingDataset(str(packed))]
    reused = sum(any(m is t for t in taken[:i]) for i, m in enumerate(taken))
    assert reused > len(taken) / 2  # most ranges in memory an earlier range had


@pytest.mark.parametrize("batch_size", [None, 4])
def test_breaking_out_of_the_loop_frees_the_read_ahead(s3: dict, packed: Path, batch_size: int | None) -> None:
    """Leaving a pass halfway stops its read-ahead threads at once, not at the next full
    garbage collection (turned off here to prove it)."""
    import gc
    import threading

    import fsspec.core

    from shardkit.reading.spec import REMOTE_DEPTH

    url, opts = s3["url"] + "/breaks", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    ds = StreamingDataset(url, storage_options=opts, shuffle=True, block=4, batch_size=batch_size)

    def prefetching() -> int:
        return sum(t.name.startswith("shardkit-prefetch") for t in threading.enumerate())

    gc.disable()
    try:
        for _ in range(8):
            for j, _ in enumerate(DataLoader(ds, batch_size=None)):
                if j == 2:
                    break
        # at most the last pool's threads: an earlier pool's fetch still running when its pass
        # was left ends with its fetch (a busy machine has seen two of them here); a pool kept
        # alive until a collection would keep its idle threads and never get under the bound
        deadline = time.monotonic() + 10
        while prefetching() > REMOTE_DEPTH and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefetching() <= REMOTE_DEPTH
        gc.collect()
    finally:
        gc.enable()


def test_cache_too_small_for_the_read_ahead(s3: dict, packed: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache_limit .* smaller than the read-ahead budget"):
        StreamingDataset(str(packed), cache_dir=str(tmp_path), cache_limit="10MB", prefetch_bytes="64MB")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cache_dir '.*file' is a file, not a folder"):
        StreamingDataset(str(packed), cache_dir=str(tmp_path / "file"))


def test_a_store_down_for_seconds_mid_epoch_loses_nothing(
    s3: dict,
    s3_server: str,
    packed: Path,
    latency_proxy,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dataset's reads get retries spanning ~21 s on average (a restart, a blip); reading
    its index, a first contact, gives up after 5 (a wrong endpoint fails fast)."""
    import threading
    import time

    import fsspec.core

    from shardkit import storage

    monkeypatch.setattr(storage.patience, "OUTAGE_RETRIES", 10)
    fs, root = fsspec.core.url_to_fs(s3["url"] + "/ds", **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(s3_server)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    ds = StreamingDataset(s3["url"] + "/ds", storage_options=opts, block=4, prefetch=2)
    got, it = [], iter(ds)
    got.append(next(it)["__key__"])
    control.set("reset_prob", 1.0)  # every connection refused its answer: the store is down...
    threading.Timer(3.0, control.set, ("reset_prob", 0.0)).start()  # ...for 3 s
    start = time.monotonic()
    got += [s["__key__"] for s in it]
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    assert control.stats()["resets"] > 0 and time.monotonic() - start > 2.5
    control.set("reset_prob", 1.0)
    with pytest.raises(ShardkitError, match=r"s3://shardkit-test/ds/index\.json: .*\(gave up after 5 attempts\)"):
        StreamingDataset(s3["url"] + "/ds", storage_options=opts)


def test_unreachable_store_fails_with_the_url(s3: dict, packed: Path, latency_proxy, s3_server: str) -> None:  # type: ignore[no-untyped-def]
    import fsspec.core

    fs, root = fsspec.core.url_to_fs(s3["url"] + "/ds", **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(s3_server)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    ds = StreamingDataset(s3["url"] + "/ds", storage_options=opts)
    verifying = StreamingDataset(s3["url"] + "/ds", storage_options=opts, verify=True)
    control.set("reset_prob", 1.0)
    with pytest.raises(
        ShardkitError, match=r"s3://shardkit-test/ds/shard-\d+\.tar \((bytes \d+-\d+|fingerprint)\): .*gave up after"
    ):
        next(iter(ds))
    with pytest.raises(ShardkitError, match=r"s3://shardkit-test/ds/shard-\d+\.tar \(sha256 check\): .*gave up after"):
        next(iter(verifying))


@pytest.mark.parametrize("store", ["gcs", "webhdfs"])
def test_a_stalled_connection_fails_in_bounded_time(
    store: str, request: pytest.FixtureRequest, packed: Path, latency_proxy, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """gcsfs and WebHDFS (requests) have no deadline of their own: a black-holed connection
    would block a read forever. shardkit gives every socket read one (1 s here, 20 s by default,
    5 s on GCS)."""
    import time
    from urllib.parse import urlsplit

    remote = request.getfixturevalue(store)
    shardkit.pack(
        str(packed.parent / "photos"),
        remote["url"] + "/ds",
        max_count=7,
        workers=1,
        progress=False,
        storage_options=remote["storage_options"],
    )
    if store == "gcs":
        proxied, control = latency_proxy(remote["storage_options"]["endpoint_url"])
        url, opts = remote["url"] + "/ds", {**remote["storage_options"], "endpoint_url": proxied}
    else:
        port = urlsplit(remote["url"]).port
        proxied, control = latency_proxy(f"http://127.0.0.1:{port}")
        url, opts = remote["url"].replace(str(port), str(urlsplit(proxied).port)) + "/ds", remote["storage_options"]
    ds = StreamingDataset(url, storage_options={**opts, "timeout": 1})
    control.set("stall_prob", 1.0)
    start = time.monotonic()
    # GCS: a shard's first request is the check of its version (generation) as it is opened
    with pytest.raises(ShardkitError, match=r"shard-\d+\.tar \((bytes \d+-\d+|version)\): .*gave up after"):
        next(iter(ds))
    assert time.monotonic() - start < 90  # gcsfs: 6 tries, ~32 s of its own backoff
    control.set("stall_prob", 0.0)


def test_shardkits_s3_client_without_retries_is_its_own(s3: dict) -> None:
    """Reads retry themselves, on an s3fs instance with its retries off; with options that
    set botocore's retries, that instance was fsspec's cached one, shared with uploads."""
    import fsspec

    from shardkit import storage

    opts = {k: v for k, v in s3["storage_options"].items() if k != "skip_instance_cache"}
    opts["config_kwargs"] = {"retries": {"max_attempts": 7}}
    theirs = fsspec.filesystem("s3", **opts)
    before = theirs.retries
    ours, _ = storage.filesystem(s3["url"] + "/x", opts, instances={}, client_retries=False)
    assert ours is not theirs and ours.retries == 1 and theirs.retries == before


def test_a_slow_but_moving_gcs_download_is_not_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline is per socket read, not per request: a trickle that takes 4x the
    timeout to finish arrives whole (an endpoint of our own that sends 100 bytes every 0.1 s:
    gaps well inside the 1.5 s timeout, even for a loaded machine's server thread)."""
    import http.server
    import time

    from servers import serving
    from shardkit import storage

    class Trickle(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(206)
            self.send_header("Content-Length", "6000")
            self.end_headers()
            for _ in range(60):
                self.wfile.write(b"x" * 100)
                self.wfile.flush()
                time.sleep(0.1)

    with serving(Trickle) as endpoint:
        opts = {"endpoint_url": endpoint, "token": "anon", "skip_instance_cache": True, "timeout": 1.5}
        fs, path = storage.filesystem("gs://bucket/slow.tar", opts)
        assert fs.cat_file(path, start=0, end=6000) == b"x" * 6000


def test_missing_backend_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    import fsspec.registry  # noqa: F401 - the module (fsspec's `registry` attribute is its mapping)

    monkeypatch.setitem(sys.modules, "adlfs", None)  # as if not installed (the test extra brings it)
    for protocol in ("az", "abfs", "abfss"):  # forget the class fsspec loaded already
        monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, protocol, raising=False)
    with pytest.raises(ShardkitError, match=r"abfs:// support is not installed \(pip install adlfs\)"):
        StreamingDataset("abfs://container/data")
    with pytest.raises(ShardkitError, match=r"oss:// support is not installed \(install the fsspec backend for oss"):
        StreamingDataset("oss://bucket/data")


@pytest.mark.parametrize("password", ["hunter2", "hun@ter2"])
def test_credentials_in_urls_stay_out_of_errors(password: str) -> None:
    with pytest.raises(Exception) as info:
        StreamingDataset(f"https://alice:{password}@127.0.0.1:9/data/shard-{{000..001}}.tar")
    assert "ter2" not in str(info.value) and "127.0.0.1:9/data/shard-000.tar" in str(info.value)


def test_pack_from_a_bucket_into_a_bucket(s3: dict, photos: Path, tmp_path: Path) -> None:
    import fsspec.core

    opts = s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(s3["url"], **opts)
    fs.put(str(photos), f"{root}/raw", recursive=True)
    fs.pipe(f"{root}/raw/circle/notes.txt", b"hello")
    local = shardkit.pack(str(photos), str(tmp_path / "local"), max_count=8, workers=1, progress=False)
    remote = shardkit.pack(
        s3["url"] + "/raw", s3["url"] + "/shards", max_count=8, workers=2, progress=False, storage_options=opts
    )
    assert remote.classes == local.classes
    assert [s.sha256 for s in remote.shards] == [s.sha256 for s in local.shards]  # the same bytes
    assert [(s.path, s.reason) for s in remote.skipped] == [("circle/notes.txt", "not an image file extension")]


def test_a_pack_from_a_bucket_reads_its_files_at_once(
    s3: dict, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job reads a bucket's files many at a time (their first-byte latency hidden), up to a
    bound on their bytes, and hands them on in order: the same shards as a pack of the local
    folder, the same skips."""
    import fsspec.core

    from shardkit import storage
    from shardkit.packing import images, jobs
    from shardkit.packing.jobs import AHEAD_BYTES, REMOTE_READS

    opts = s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(s3["url"], **opts)
    fs.put(str(photos), f"{root}/raw", recursive=True)
    fs.pipe(f"{root}/raw/square/broken.jpg", b"\xff\xd8\xff\xe0garbage")
    (photos / "square" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    lock = threading.Lock()
    now, most = {"read": 0, "reencode": 0}, {"read": 0, "reencode": 0}

    def counted(what: str, fn: Callable[..., bytes]) -> Callable[..., bytes]:
        def call(*args: Any, **kwargs: Any) -> bytes:
            with lock:
                now[what] += 1
                most[what] = max(most[what], now[what])
            try:
                time.sleep(0.02)  # a first byte some way off, an image some time to re-encode
                return fn(*args, **kwargs)
            finally:
                with lock:
                    now[what] -= 1

        return call

    smallest = min(p.stat().st_size for p in photos.rglob("*.jpg"))
    for options, ahead_bytes, reads in (
        ({}, AHEAD_BYTES, REMOTE_READS),
        ({"resize": 32}, AHEAD_BYTES, REMOTE_READS),
        ({}, 3 * smallest, 3),
    ):  # 3 files' bytes at least: 3 files ahead
        local = shardkit.pack(
            str(photos), str(tmp_path / "local"), workers=1, progress=False, overwrite=True, **options
        )
        most.update(read=0, reencode=0)
        with monkeypatch.context() as patched:
            patched.setattr(storage, "read_bytes", counted("read", storage.read_bytes))
            patched.setattr(images, "reencode", counted("reencode", images.reencode))
            patched.setattr(jobs, "AHEAD_BYTES", ahead_bytes)
            remote = shardkit.pack(
                s3["url"] + "/raw",
                str(tmp_path / "remote"),
                workers=1,
                progress=False,
                overwrite=True,
                storage_options=opts,
                **options,
            )
        assert 1 < most["read"] <= reads
        assert most["reencode"] == (1 if options else 0)  # decoding: one core's worth (workers=1)
        assert [s.sha256 for s in remote.shards] == [s.sha256 for s in local.shards]
        assert [(s.path, s.reason) for s in remote.skipped] == [(s.path, s.reason) for s in local.skipped]
        assert [s.path for s in remote.skipped] == ["square/broken.jpg"]


def test_a_conversion_from_a_bucket_downloads_each_shard_once(
    s3: dict, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converting a dataset in a bucket downloads each shard once, checking it as it comes,
    and copies its samples from that copy (not a download to check it, then a request a
    sample or a block), though it spans several jobs: the same shards as converting it from
    local disk, a damaged shard's samples skipped alike; no copy is left behind."""
    from shardkit import storage
    from shardkit.packing import jobs

    opts = s3["storage_options"]
    src = tmp_path / "src"
    shardkit.pack(str(photos), str(src), max_count=7, workers=1, progress=False)
    damaged = bytearray((src / "shard-000001.tar").read_bytes())
    damaged[2000] ^= 0x01
    (src / "shard-000001.tar").write_bytes(bytes(damaged))
    for shard in src.iterdir():
        storage.write_bytes_atomic(f"{s3['url']}/ds/{shard.name}", shard.read_bytes(), opts)
    local = shardkit.pack(str(src), str(tmp_path / "local"), max_count=3, workers=1, progress=False)
    opened: list[str] = []
    ranges: list[str] = []
    open_read, read_range = storage.open_read, storage.read_range
    monkeypatch.setattr(storage, "open_read", lambda url, *a, **k: (opened.append(url), open_read(url, *a, **k))[1])
    monkeypatch.setattr(storage, "read_range", lambda url, *a, **k: (ranges.append(url), read_range(url, *a, **k))[1])
    remote = shardkit.pack(
        s3["url"] + "/ds", str(tmp_path / "remote"), max_count=3, workers=1, progress=False, storage_options=opts
    )
    assert [s.sha256 for s in remote.shards] == [s.sha256 for s in local.shards]
    assert [(s.path, s.reason) for s in remote.skipped] == [(s.path, s.reason) for s in local.skipped]
    assert remote.skipped and all(
        s.path.startswith("shard-000001.tar@") and "sha256 mismatch" in s.reason for s in remote.skipped
    )
    shards = sorted(f"{s3['url']}/ds/{p.name}" for p in src.glob("*.tar"))
    assert sorted(u for u in opened if u.endswith(".tar")) == shards and ranges == []  # 5 shards, 3 jobs or more each
    assert jobs._copy is None  # let go after the last shard's last sample


def test_a_conversion_from_a_bucket_needs_room_for_its_copies(
    s3: dict, photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A temporary folder that cannot hold a source shard's copy (here: files may not grow
    past 10 KB) stops the pack with one line naming it, not a skip of the shard's samples nor
    the bucket blamed; a resumed pack whose last job leaves the next one's shard half read
    keeps no copy open after it."""
    import resource
    import signal

    from shardkit import storage
    from shardkit.errors import ShardkitError
    from shardkit.packing import jobs
    from shardkit.packing.plan import JobList, make_plan

    opts = s3["storage_options"]
    src = tmp_path / "src"
    shardkit.pack(str(photos), str(src), max_count=7, workers=1, progress=False)
    for shard in src.iterdir():
        storage.write_bytes_atomic(f"{s3['url']}/ds/{shard.name}", shard.read_bytes(), opts)
    limit, quiet = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10 << 10, limit[1]))
    try:
        with pytest.raises(
            ShardkitError,
            match=r"^/\S+: cannot hold a copy of s3://\S+/ds/shard-000000\.tar "
            r"\(File too large\); set TMPDIR",
        ):
            shardkit.pack(
                s3["url"] + "/ds", str(tmp_path / "out"), max_count=3, workers=1, progress=False, storage_options=opts
            )
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, quiet)
    assert not (tmp_path / "out" / "index.json").exists()
    plan = make_plan(s3["url"] + "/ds", "unused", max_count=3, storage_options=opts)  # jobs 0-1 in shard 0
    assert plan.job(0, then=1).source_goes_on and not JobList(plan, [0])[0].source_goes_on
    list(jobs.job_samples(JobList(plan, [0])[0]))  # the last job of a resumed run
    assert jobs._copy is None


@pytest.mark.parametrize("protocol", ["s3", "gs"])
def test_forbidden_fails_at_once_naming_the_url(forbidding: tuple[str, list[str]], protocol: str) -> None:
    """Credentials without access (HTTP 403) are not a transient error: one request, then a
    PermissionError that names the URL, from the dataset and from the CLI (exit code 1)."""
    endpoint, log = forbidding
    if protocol == "s3":
        opts: dict[str, Any] = {
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": endpoint},
            "skip_instance_cache": True,
        }
    else:
        opts = {"token": "anon", "project": "test", "endpoint_url": endpoint, "skip_instance_cache": True}
    url = f"{protocol}://bucket/ds"
    with pytest.raises(PermissionError, match=f"{url}/index.json"):
        StreamingDataset(url, storage_options=opts)
    assert len(log) == 1, log
    args = [f"-o{k}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in opts.items()]
    done = subprocess.run(
        [sys.executable, "-m", "shardkit", "verify", url, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and f"{url}/index.json" in done.stderr and len(done.stderr.splitlines()) == 1, done


@pytest.mark.parametrize("first", ["local", "remote"])
def test_a_list_mixing_local_and_remote_shards(s3: dict, photos: Path, tmp_path: Path, first: str) -> None:
    """Shards given as a list may mix local paths and URLs: each is read its own way."""
    url, opts = s3["url"] + "/ds", s3["storage_options"]
    shardkit.pack(str(photos), str(tmp_path / "local"), max_count=7, workers=1, progress=False)
    shardkit.pack(str(photos), url, max_count=7, workers=1, progress=False, storage_options=opts)
    names = sorted(p.name for p in (tmp_path / "local").glob("*.tar"))
    where = [str(tmp_path / "local"), url] if first == "local" else [url, str(tmp_path / "local")]
    shards = [f"{where[i % 2]}/{name}" for i, name in enumerate(names)]
    expected = read_shards(tmp_path / "local")
    for workers in (0, 2):
        got = [
            s["__key__"]
            for s in DataLoader(
                StreamingDataset(shards, storage_options=opts, shuffle=True), batch_size=None, num_workers=workers
            )
        ]
        assert sorted(got) == sorted(expected)
