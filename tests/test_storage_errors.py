"""Storage failures against real servers on loopback (tests/servers/): a failed upload
leaves nothing behind, every failure is one line naming the URL without its credentials,
errors no retry can fix fail at once, and a truncated shard is bad data, not a store failure."""

from __future__ import annotations

import contextlib
import functools
import gc
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import fsspec.core
import pytest

import shardkit
from shardkit import StreamingDataset, storage
from shardkit.errors import CorruptShardError, ShardkitError
from shardkit.index.resolve import local_lmdb

from conftest import draw, make_folder, shard_offsets
from servers import self_signed, serving


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shardkit", *args], capture_output=True, text=True, timeout=120)


def dead_endpoint() -> str:
    """An address where nothing listens: every connection is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    """A static file server that ignores Range headers, as `python -m http.server` does."""

    def log_message(self, *args: object) -> None:
        pass


class _Ranges(_Quiet):
    """The same with single byte ranges, answered as S3, GCS and nginx do (206, 416)."""

    def do_GET(self) -> None:
        path, spec = self.translate_path(self.path), self.headers.get("Range", "")
        if not spec.startswith("bytes=") or not os.path.isfile(path):
            return super().do_GET()
        size = os.path.getsize(path)
        first, _, last = spec.removeprefix("bytes=").partition("-")
        start, stop = (int(first), min(size, int(last) + 1 if last else size)) if first else (size - int(last), size)
        if start >= size:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as f:
            body = os.pread(f.fileno(), stop - start, max(start, 0))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _CutShort(_Ranges):
    """The first answer to each range stops halfway through its body and drops the connection,
    as a server restarting or a proxy timing out does; asked again, the range comes whole.
    Keyed by range, not by a count of answers, so concurrent reads cannot all land on cut ones."""

    cut: ClassVar[set[tuple[str, str]]] = set()

    def end_headers(self) -> None:
        super().end_headers()
        asked = (self.path, self.headers.get("Range", ""))
        if asked[1] and self.command == "GET" and asked not in self.cut:
            self.cut.add(asked)
            self.wfile.write = self._half  # type: ignore[method-assign]

    def _half(self, body: bytes) -> int:
        self.close_connection = True
        with contextlib.suppress(OSError):  # the client may have hung up first
            self.connection.sendall(body[: len(body) // 2])
            self.connection.shutdown(socket.SHUT_RDWR)
        return len(body)


@pytest.fixture
def web(tmp_path: Path, packed: Path) -> Iterator[tuple[str, Path]]:
    """(base URL, folder) of an HTTP server with range requests over a folder holding the
    packed dataset as ds/."""
    (tmp_path / "www").mkdir()
    os.symlink(packed, tmp_path / "www" / "ds")
    with serving(functools.partial(_Ranges, directory=str(tmp_path / "www"))) as base:
        yield base, tmp_path / "www"


def _fail_an_upload(url: str, opts: dict) -> None:
    try:
        with storage.atomic_writer(url, opts) as f:
            f.write(b"x" * 3000)
            raise RuntimeError("the caller failed")
    except RuntimeError:
        pass  # the traceback, which holds the upload's file, is dropped here: the file is garbage


def test_a_failed_upload_leaves_nothing_behind(remote: dict) -> None:
    """A discarded upload still open would upload what it holds when garbage-collected
    (GCS: a partial object under the final name; WebHDFS: its temporary file)."""
    url, opts = remote["url"] + "/ds", remote["storage_options"]
    storage.makedirs(url, opts)
    _fail_an_upload(url + "/shard-000000.tar", opts)
    gc.collect()
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.invalidate_cache()
    assert fs.find(root) == []


def test_a_failed_pack_commits_no_partial_shard(remote: dict, photos: Path) -> None:
    (photos / "circle" / "img_0002.jpg").write_bytes(b"not an image")
    url, opts = remote["url"] + "/ds", remote["storage_options"]
    with pytest.raises(ShardkitError, match="img_0002.jpg: not an image file"):
        shardkit.pack(
            str(photos),
            url,
            max_count=100,
            workers=1,
            shuffle=False,
            on_error="raise",
            progress=False,
            storage_options=opts,
        )
    gc.collect()
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.invalidate_cache()
    assert [p for p in fs.find(root) if ".tar" in p] == []


def test_credentials_stay_out_of_messages_and_output(web: tuple[str, Path]) -> None:
    base, _ = web
    signed = f"{base}/ds/shard-999999.tar?X-Amz-Signature=SECRETSIG"
    for call in (
        lambda: storage.read_bytes(signed),
        lambda: storage.read_range(signed, 0, 10),
        lambda: StreamingDataset([signed]),
    ):
        with pytest.raises(FileNotFoundError) as info:
            call()
        assert "SECRETSIG" not in str(info.value) and "shard-999999.tar" in str(info.value)
    with_password = base.replace("http://", "http://alice:SECRETPW@") + "/ds"
    assert shardkit.verify(with_password) == []
    verify, info_out = cli("verify", with_password), cli("info", with_password)
    assert verify.returncode == 0 and info_out.returncode == 0
    assert "dataset:  http://***@127.0.0.1" in info_out.stdout
    for done in (verify, info_out):
        assert "SECRETPW" not in done.stdout + done.stderr


def test_verify_names_bad_shards_without_credentials(web: tuple[str, Path], packed: Path) -> None:
    base, www = web
    os.unlink(www / "ds")
    (www / "ds").mkdir()
    for p in packed.iterdir():
        if p.name != "shard-000001.tar":
            (www / "ds" / p.name).symlink_to(p)
    url = base.replace("http://", "http://alice:SECRETPW@") + "/ds"
    problems = shardkit.verify(url)
    assert problems == [f"http://***@{base.removeprefix('http://')}/ds/shard-000001.tar: missing"]
    done = cli("verify", "-q", url)
    assert done.returncode == 1 and "SECRETPW" not in done.stdout + done.stderr
    assert "BAD  http://***@" in done.stderr


def test_a_webhdfs_delegation_token_stays_out_of_errors() -> None:
    """urllib3 names the request without its scheme ("Max retries exceeded with url:
    /webhdfs/v1/ds/index.json?op=OPEN&delegation=..."): the query is hidden all the same."""
    url = dead_endpoint().replace("http://", "webhdfs://") + "/ds"
    done = cli("info", url, "-o", "token=SECRETTOKEN")
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done
    assert f"{url}/index.json" in done.stderr and "SECRETTOKEN" not in done.stderr


def test_options_a_store_refuses_are_one_line() -> None:
    done = cli("info", "webhdfs://127.0.0.1:9/ds", "-o", "user=u", "-o", "token=SECRETTOKEN")
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done
    assert "webhdfs://127.0.0.1:9/ds/index.json: storage options refused by webhdfs://" in done.stderr


class _Datanode(http.server.BaseHTTPRequestHandler):
    """In front of a WebHDFS datanode: passes reads on, counting the bytes sent, and answers
    the first request for every `fail_every`-th range with `fail_status` and HDFS's
    RemoteException JSON, as a failing datanode does (its retry goes through)."""

    upstream = ""
    fail_every = 0
    fail_status = 500
    answers = sent = 0
    seen: set[str] = set()

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        import json
        import urllib.request

        cls = type(self)
        cls.answers += 1
        first = self.path not in cls.seen
        cls.seen.add(self.path)
        if cls.fail_every and first and len(cls.seen) % cls.fail_every == 0:
            status, body = (
                cls.fail_status,
                json.dumps(
                    {
                        "RemoteException": {
                            "exception": "IOException",
                            "javaClassName": "java.io.IOException",
                            "message": "DataNode is overloaded, try again",
                        }
                    }
                ).encode(),
            )
        else:
            with urllib.request.urlopen(cls.upstream + self.path) as answer:
                status, body = answer.status, answer.read()
        cls.sent += len(body)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("fail_every, fail_status", [(0, 500), (2, 500), (2, 403)])
def test_webhdfs_reads_take_their_range_and_no_error_page(
    webhdfs: dict,
    webhdfs_server,
    packed: Path,  # type: ignore[no-untyped-def]
    fail_every: int,
    fail_status: int,
) -> None:
    """A block is one OPEN of its bytes (fsspec's buffered file read 4 MiB past each: 8x the
    data here), and a datanode's error page is a failed read, tried again, never the file's
    bytes (it was: an index.json that "is not a shardkit index", a sha256 "changed"). HDFS's
    datanodes answer any IOException (a bad replica, an expired block token) with 403."""
    url, opts = webhdfs["url"] + "/ds", webhdfs["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    datanode = type(
        "Datanode",
        (_Datanode,),
        {
            "upstream": webhdfs_server.datanode,
            "fail_every": fail_every,
            "fail_status": fail_status,
            "seen": {"(index.json: the 2nd)"},
        },
    )
    with serving(datanode) as proxy:
        opts = {**opts, "data_proxy": {webhdfs_server.datanode.removeprefix("http://"): proxy.removeprefix("http://")}}
        index = (packed / "index.json").read_bytes()
        assert [storage.read_bytes(url + "/index.json", opts) for _ in range(3)] == [index] * 3
        datanode.sent = 0
        want = [s["__key__"] for s in StreamingDataset(str(packed), shuffle=True, seed=2, block=2)]
        ds = StreamingDataset(url, storage_options=opts, shuffle=True, seed=2, block=2, verify=bool(fail_every))
        assert [s["__key__"] for s in ds] == want  # with verify, each shard's sha256 is read too
    shards = sum(p.stat().st_size for p in packed.glob("*.tar"))
    assert datanode.answers > 10
    if not fail_every:  # each block of 2 samples once (the rest of its shard, and more, before)
        assert datanode.sent < 1.1 * shards


def test_filesystems_are_set_up_once_and_take_fsspecs_defaults(webhdfs: dict) -> None:
    """fsspec hands out one instance for the same options, and each reader asks again: its
    session gets shardkit's hook once. An option left at fsspec's default None works."""
    url, opts = webhdfs["url"], {k: v for k, v in webhdfs["storage_options"].items() if k != "skip_instance_cache"}
    first, _ = storage.filesystem(url, opts, instances={})
    again, _ = storage.filesystem(url, opts, instances={})
    assert again is first and len(first.session.hooks["response"]) == 1
    fs, _ = storage.filesystem("https://example.invalid/ds", {"client_kwargs": None})
    assert fs.client_kwargs["timeout"].sock_read == storage.TIMEOUT_S


def test_a_gcs_client_that_fails_as_it_is_made_is_one_line_naming_the_url() -> None:
    """gcsfs checks credentials as it is made: a key that does not parse (or a token check
    that cannot reach Google) was a bare KeyError (or a ConnectionError holding the token)."""
    account = {
        "type": "service_account",
        "client_email": "a@b.iam.gserviceaccount.com",
        "private_key_id": "k1",
        "private_key": "-----BEGIN PRIVATE KEY-----\nnot-a-key\n-----END PRIVATE KEY-----\n",
        "token_uri": dead_endpoint() + "/token",
    }
    with pytest.raises(ShardkitError, match=r"^gs://bkt/ds/index\.json: cannot set up gs://: \w+"):
        StreamingDataset("gs://bkt/ds", storage_options={"token": account, "endpoint_url": dead_endpoint()})


def test_a_gcs_endpoint_that_does_not_resolve_fails_at_once() -> None:
    """gcsfs tries a request 6 times over ~35 s whatever failed, so a host that does not
    resolve (no network, a typo) took ~45 s to be named: the first contact looks it up."""
    opts = {"token": "anon", "endpoint_url": "http://nohost.invalid:4443"}  # .invalid never resolves
    start = time.monotonic()
    with pytest.raises(
        ShardkitError,
        match=r"^gs://bkt/ds/index\.json: cannot resolve nohost\.invalid \(.+\): no "
        r"network, or a wrong endpoint$",
    ):
        StreamingDataset("gs://bkt/ds", storage_options=opts)
    assert time.monotonic() - start < 20  # gcsfs's backoff alone sleeps 31 s
    done = cli("verify", "gs://bkt/ds", *(f"-o{k}={v}" for k, v in opts.items()))
    assert done.returncode == 1 and done.stderr.startswith("Error: gs://bkt/ds/index.json: cannot resolve nohost")
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_gcsfs_prints_no_traceback_of_its_own() -> None:
    """gcsfs logs a request it gives up on with its traceback (Python's last-resort handler
    prints it where logging is not set up): only shardkit's one line reaches stderr."""

    class Refuse(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            body = b'{"error": {"code": 400, "message": "no such thing here"}}'
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Refuse) as base:
        done = cli("info", "gs://bkt/ds", "-o", f"endpoint_url={base}", "-o", "token=anon")
    assert done.returncode == 1 and done.stderr.splitlines() == [
        "Error: gs://bkt/ds/index.json: no such thing here, 400"
    ], done.stderr


def test_a_client_option_with_a_typo_fails_at_once(s3: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """An option no retry can fix fails at its first attempt: no backoff before another."""
    waits: list[None] = []
    monkeypatch.setattr(storage.retry, "_before_wait", lambda: waits.append(None))  # called before each backoff
    opts = s3["storage_options"]
    typo = {**opts, "client_kwargs": {**opts["client_kwargs"], "endpoint": "x"}}
    with pytest.raises(
        ShardkitError,
        match=r"^s3://shardkit-test/ds/index\.json: .*unexpected keyword argument "
        r"'endpoint'$",
    ):
        StreamingDataset(s3["url"] + "/ds", storage_options=typo)
    assert waits == []  # not 5 attempts with backoff (4 waits)


class _IndexDown(_Ranges):
    """The shards as usual; index.json answers 503 every time."""

    def do_GET(self) -> None:
        if self.path.endswith("/index.json"):
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()


def test_shards_listed_by_url_beside_an_index_the_store_keeps_failing_raise(tmp_path: Path, packed: Path) -> None:
    """Not a scan of every shard instead (each read whole, from the same failing store)."""
    (tmp_path / "www").mkdir()
    os.symlink(packed, tmp_path / "www" / "ds")
    with serving(functools.partial(_IndexDown, directory=str(tmp_path / "www"))) as base:
        urls = [f"{base}/ds/{p.name}" for p in sorted(packed.glob("*.tar"))]
        with pytest.raises(ShardkitError, match=rf"^{base}/ds/index\.json: .*503.*\(gave up after 5 attempts\)$"):
            StreamingDataset(urls)


def test_local_and_remote_shards_in_one_list(web: tuple[str, Path], packed: Path) -> None:
    base, _ = web
    names = [s.name for s in shardkit.index.load(str(packed)).shards]
    urls = [str(packed / n) if i % 2 else f"{base}/ds/{n}" for i, n in enumerate(names)]
    on_disk = [s["__key__"] for s in StreamingDataset([str(packed / n) for n in names], shuffle=True, seed=4)]
    assert [s["__key__"] for s in StreamingDataset(urls, shuffle=True, seed=4, prefetch_bytes="10KB")] == on_disk


def test_a_shard_without_a_sha256_is_not_cached(web: tuple[str, Path], tmp_path: Path) -> None:
    from shardkit.storage.cache import RangeCache

    base, www = web
    (www / "x.tar").write_bytes(b"a" * 4096)
    cache = RangeCache(str(tmp_path / "cache"), limit=1 << 20)
    assert storage.RangeReader([f"{base}/x.tar"], versions=[None], cache=cache).read(0, 0, 100) == b"a" * 100
    (www / "x.tar").write_bytes(b"b" * 4096)  # replaced: nothing tells it apart but the bytes
    assert storage.RangeReader([f"{base}/x.tar"], versions=[None], cache=cache).read(0, 0, 100) == b"b" * 100


def test_hdfs_without_pyarrow_says_what_to_install() -> None:
    import importlib.util

    if importlib.util.find_spec("pyarrow") is not None:
        pytest.skip("pyarrow is installed here: the message is for machines without it")
    with pytest.raises(ShardkitError, match=r"^hdfs://nn:8020/ds: hdfs:// support is not installed .*pyarrow"):
        storage.filesystem("hdfs://nn:8020/ds", None)


def test_a_body_cut_short_is_tried_again(tmp_path: Path, packed: Path) -> None:
    (tmp_path / "www").mkdir()
    os.symlink(packed, tmp_path / "www" / "ds")
    on_disk = {s["__key__"]: s["jpg"] for s in StreamingDataset(str(packed))}
    _CutShort.cut.clear()
    with serving(functools.partial(_CutShort, directory=str(tmp_path / "www"))) as base:
        got = {s["__key__"]: s["jpg"] for s in StreamingDataset(base + "/ds", block=16)}
    assert got == on_disk and len(_CutShort.cut) >= len(got) // 16


def test_a_shard_being_hashed_holds_up_no_other_shard_nor_close(tmp_path: Path, packed: Path) -> None:
    asked, gate = threading.Event(), threading.Event()

    class Held(_Ranges):
        def do_GET(self) -> None:
            if self.path.endswith("shard-000000.tar"):
                asked.set()
                gate.wait(30)
            super().do_GET()

    (tmp_path / "www").mkdir()
    os.symlink(packed, tmp_path / "www" / "ds")
    shards = shardkit.index.load(str(packed)).shards[:2]
    opened = threading.Timer(15, gate.set)  # only if the reads below wait for the held hash: they must not
    with serving(functools.partial(Held, directory=str(tmp_path / "www"))) as base:
        reader = storage.RangeReader(
            [f"{base}/ds/{s.name}" for s in shards], versions=[s.sha256 for s in shards], verify=True
        )
        errors: list[BaseException] = []
        first = threading.Thread(target=lambda: errors.append(pytest.raises(ShardkitError, reader.read, 0, 0, 10)))
        first.start()
        opened.start()
        assert asked.wait(30)
        assert reader.read(1, 0, 512)[:6] == (packed / shards[1].name).read_bytes()[:6]  # hashed and read meanwhile
        reader.close()
        assert not gate.is_set()  # neither waited for shard 0's hash
        gate.set()
        first.join(30)
        opened.cancel()
    assert "closed" in str(errors[0].value)


@pytest.mark.parametrize("block", [1, 64])
def test_a_truncated_shard_is_bad_data_on_every_store(remote: dict, packed: Path, block: int) -> None:
    """A range past the new end (S3 answers 416) is the shard's problem, not the store's:
    CorruptShardError saying where it ends, and only samples past the cut skipped."""
    url, opts = remote["url"] + "/ds", remote["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    whole = (packed / "shard-000000.tar").read_bytes()
    fs.pipe(f"{root}/shard-000000.tar", whole[: len(whole) // 2])
    with pytest.raises(CorruptShardError, match=rf"shard-000000\.tar .*the shard ends at byte {len(whole) // 2}"):
        list(StreamingDataset(url, storage_options=opts, block=block))
    ds = StreamingDataset(url, storage_options=opts, block=block, on_error="skip")
    assert len(list(ds)) == 120
    assert 0 < ds.stats()["skipped"] < 7


@pytest.mark.parametrize("cut", ["at a sample's start", "to nothing"])
def test_a_shard_cut_at_a_sample_boundary_or_emptied_is_bad_data_on_every_store(
    remote: dict, packed: Path, cut: str
) -> None:
    """A range that starts exactly at the new end: HDFS refuses that offset (the namenode
    with 403, or for an empty file the datanode), where the other stores answer no bytes."""
    url, opts = remote["url"] + "/ds", remote["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    shard = shardkit.index.load(str(packed)).shards[0]
    keep = shard_offsets(packed)[shard.name][3] if cut == "at a sample's start" else 0
    fs.pipe(f"{root}/{shard.name}", (packed / shard.name).read_bytes()[:keep])
    with pytest.raises(CorruptShardError, match=rf"{shard.name} .*the shard ends at"):
        list(StreamingDataset(url, storage_options=opts, block=1))
    ds = StreamingDataset(url, storage_options=opts, block=1, on_error="skip")
    assert len(list(ds)) == 120 and ds.stats()["skipped"] == shard.samples - (3 if keep else 0)


def test_streaming_over_http_gives_the_samples_on_disk(web: tuple[str, Path], packed: Path) -> None:
    from torch.utils.data import DataLoader

    base, _ = web
    on_disk = {s["__key__"]: s["jpg"] for s in StreamingDataset(str(packed))}
    over_http = StreamingDataset(base + "/ds", shuffle=True)
    assert {s["__key__"]: s["jpg"] for s in over_http} == on_disk and len(on_disk) == 120
    keys = [k for batch in DataLoader(over_http, batch_size=8, num_workers=2) for k in batch["__key__"]]
    assert sorted(keys) == sorted(on_disk)


@pytest.mark.parametrize("block", [1, 64])
def test_a_truncated_shard_over_http_is_bad_data(web: tuple[str, Path], packed: Path, block: int) -> None:
    """A range past the new end (416) or running past it (fewer bytes): the shard's problem."""
    base, www = web
    os.unlink(www / "ds")
    shutil.copytree(packed, www / "ds")
    whole = (packed / "shard-000000.tar").read_bytes()
    (www / "ds" / "shard-000000.tar").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CorruptShardError, match=rf"shard-000000\.tar .*the shard ends at byte {len(whole) // 2}"):
        list(StreamingDataset(base + "/ds", block=block))
    ds = StreamingDataset(base + "/ds", block=block, on_error="skip")
    assert len(list(ds)) == 120 and 0 < ds.stats()["skipped"] < 7


def test_a_stalled_http_connection_fails_in_bounded_time(
    web: tuple[str, Path],
    latency_proxy,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiohttp's own deadline is 300 s a request (5 attempts: 25 minutes for a black hole,
    and a slow download cut off at 5 minutes): shardkit gives each socket read one instead."""
    base, _ = web
    proxied, control = latency_proxy(base)
    ds = StreamingDataset(f"{proxied}/ds", storage_options={"timeout": 1})
    control.set("stall_prob", 1.0)
    start = time.monotonic()
    with pytest.raises(
        ShardkitError, match=r"shard-\d+\.tar \((bytes \d+-\d+|fingerprint)\): .*gave up after 3 attempts"
    ):
        next(iter(ds))
    assert time.monotonic() - start < 60
    control.set("stall_prob", 0.0)


def test_a_server_that_ignores_ranges_is_named_not_blamed_on_the_shard(packed: Path, tmp_path: Path) -> None:
    (tmp_path / "www").mkdir()
    os.symlink(packed, tmp_path / "www" / "ds")
    with serving(functools.partial(_Quiet, directory=str(tmp_path / "www"))) as base:
        for ds in (StreamingDataset(base + "/ds"), StreamingDataset(base + "/ds", on_error="skip")):
            with pytest.raises(
                ValueError,
                match=rf"^{base}/ds/shard-0000\d\d\.tar: the server sent \d+ bytes for a "
                r"range of \d+: it ignores range requests",
            ):
                next(iter(ds))
        with pytest.raises(ValueError, match="ignores range requests"):
            storage.read_range(base + "/ds/shard-000000.tar", 512, 1024)


@pytest.mark.parametrize("protocol", ["http", "webhdfs"])
def test_forbidden_over_http_and_webhdfs_fails_at_once(forbidding: tuple[str, list[str]], protocol: str) -> None:
    endpoint, log = forbidding
    url = endpoint.replace("http", protocol, 1) + "/ds/shard-000000.tar"
    opts = {"user": "u"} if protocol == "webhdfs" else None
    with pytest.raises(PermissionError, match=f"^{url}: .*403"):
        storage.read_range(url, 0, 100, opts)
    with pytest.raises(PermissionError, match=rf"^{url} \(bytes 0-100\): .*403"):
        storage.RangeReader([url], opts).read(0, 0, 100)
    assert len(log) == 2, log


def test_no_credentials_and_an_invalid_bucket_fail_at_once(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    anonymous = {"client_kwargs": {"endpoint_url": s3_server}, "skip_instance_cache": True}
    with pytest.raises(PermissionError, match=r"^s3://bucket/ds/index\.json: Unable to locate credentials$"):
        storage.read_bytes("s3://bucket/ds/index.json", anonymous)
    opts = {**anonymous, "key": "testing", "secret": "testing"}
    with pytest.raises(ValueError, match=r"^s3://b!/ds/index\.json: .*Invalid bucket name"):
        storage.read_bytes("s3://b!/ds/index.json", opts)


@pytest.mark.parametrize("store", ["s3", "gcs", "azure"])
def test_a_pack_into_a_bucket_that_is_not_there_creates_none(
    store: str, request: pytest.FixtureRequest, photos: Path
) -> None:
    """fsspec's makedirs creates buckets: a typo in the bucket's name made a new one."""
    import fsspec

    remote = request.getfixturevalue(store)
    typo = remote["url"] + "-typo"
    with pytest.raises(FileNotFoundError, match=rf"^{typo}/ds/\S+: .*(bucket|Not Found|404)"):
        shardkit.pack(str(photos), typo + "/ds", workers=1, progress=False, storage_options=remote["storage_options"])
    fs = fsspec.filesystem(remote["url"].split("://")[0], **remote["storage_options"])
    assert not fs.exists(typo.split("://")[1])


def test_every_storage_call_fails_in_one_line_naming_the_url(forbidding: tuple[str, list[str]]) -> None:
    """exists, size, listdir, remove, open_read and uploads: no raw client error (makedirs
    asks nothing of an object store)."""
    endpoint, _ = forbidding
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    url = "s3://bucket/ds/x.tar"
    calls = {
        "exists": lambda: storage.exists(url, opts),
        "size": lambda: storage.size(url, opts),
        "listdir": lambda: storage.listdir(url, opts),
        "remove": lambda: storage.remove(url, opts),
        "open_read": lambda: storage.open_read(url, opts),
        "upload": lambda: storage.write_bytes_atomic(url, b"data", opts),
    }
    for name, call in calls.items():
        with pytest.raises(PermissionError) as info:
            call()
        assert isinstance(info.value, ShardkitError) and str(info.value).startswith(url), name


def test_a_dead_endpoint_fails_in_seconds_naming_the_url(photos: Path) -> None:
    endpoint = dead_endpoint()
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    with pytest.raises(ShardkitError, match=r"^s3://bucket/ds/shard-000000\.tar: .*gave up after 5 attempts"):
        StreamingDataset(["s3://bucket/ds/shard-000000.tar"], storage_options=opts)
    flags = ["-o", "key=k", "-o", "secret=s", "-o", f"endpoint_url={endpoint}"]
    start = time.monotonic()
    info = cli("info", "s3://bucket/ds", *flags)  # botocore's own retries were 5 x ours: 39 s
    assert time.monotonic() - start < 20
    pack = cli("pack", str(photos), "s3://bucket/out", "-q", *flags)
    for done, url in (
        (info, "s3://bucket/ds/index.json"),
        (pack, "s3://bucket/out/.shardkit-lock"),
    ):  # its first request
        assert done.returncode == 1 and done.stderr.startswith(f"Error: {url}: "), done
        assert len(done.stderr.splitlines()) == 1, done.stderr


def test_reads_stop_retrying_once_the_reader_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `break` out of the loop closes the reader: read-ahead still retrying a failing
    store gives up at its next attempt instead of going on at the store."""
    opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": dead_endpoint()}}
    reader = storage.RangeReader(["s3://bucket/ds/shard-000000.tar"], opts)
    failed: list[Exception] = []

    def read() -> None:
        try:
            reader.read(0, 0, 100)
        except ShardkitError as e:
            failed.append(e)

    backing_off, closed = threading.Event(), threading.Event()

    def first_wait() -> None:  # the first attempt has failed: it backs off until the reader is closed
        backing_off.set()
        closed.wait(30)

    monkeypatch.setattr(storage.retry, "_before_wait", first_wait)  # called before each backoff
    thread = threading.Thread(target=read)
    thread.start()
    assert backing_off.wait(30)
    reader.close()
    closed.set()
    thread.join(30)
    assert [str(e) for e in failed] == ["read after the reader was closed"]


def _lmdb(photos: Path, dest: Path, seed: int) -> Path:
    for i, p in enumerate(sorted(photos.rglob("*.jpg"))):  # the same names, other pictures
        draw(p, 0, seed=seed + i, size=(56, 48))
    shardkit.pack(str(photos), str(dest), format="lmdb", workers=1, progress=False)
    return dest


def test_a_replaced_remote_lmdb_is_fetched_again(s3: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    photos = make_folder(tmp_path / "photos", per_class=3)
    old, new = _lmdb(photos, tmp_path / "v1", 1), _lmdb(photos, tmp_path / "v2", 1000)
    url, opts = s3["url"] + "/ds", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    cache = str(tmp_path / "cache")

    def upload(folder: Path) -> dict[str, bytes]:
        if fs.exists(root):
            fs.rm(root, recursive=True)
        fs.put(str(folder), root, recursive=True)
        return {s["__key__"]: s["jpg"] for s in StreamingDataset(url, storage_options=opts, cache_dir=cache)}

    upload(old)
    assert upload(new) == {s["__key__"]: s["jpg"] for s in StreamingDataset(str(new))}
    assert len(os.listdir(next(Path(cache, "lmdb").iterdir()))) == 1  # the old copy is gone
    with pytest.raises(ShardkitError, match=r"^s3://shardkit-test/ds/data\.mdb: \d+ bytes do not fit in cache_limit"):
        local_lmdb(url, opts, str(tmp_path / "small"), cache_limit=16_000)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # verify's copy goes to the default cache
    fs.put_file(str(old / "index.json"), f"{root}/index.json")  # data.mdb of one pack, index.json of another
    assert shardkit.verify(url, opts) == [f"{url}: index.json differs from the index stored in data.mdb"]


def test_a_remote_lmdb_replaced_while_it_is_copied_is_not_kept(
    s3: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that mixes two versions of data.mdb must not be kept under the first one's name."""
    photos = make_folder(tmp_path / "photos", per_class=3)
    old, new = _lmdb(photos, tmp_path / "v1", 1), _lmdb(photos, tmp_path / "v2", 1000)
    url, opts = s3["url"] + "/racing", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(old), root, recursive=True)
    open_read = storage.open_read

    def replaced_after_the_first_read(url: str, storage_options: dict) -> object:
        f = open_read(url, storage_options)
        read = f.read

        def read_then_replace(n: int = -1) -> bytes:
            data = read(n)
            fs.put_file(str(new / "data.mdb"), f"{root}/data.mdb")
            return data

        f.read = read_then_replace  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(storage, "open_read", replaced_after_the_first_read)
    cache = tmp_path / "cache"
    with pytest.raises(ShardkitError, match=r"^s3://shardkit-test/racing/data\.mdb: replaced while it was copied"):
        local_lmdb(url, opts, str(cache))
    assert not [p for p in cache.rglob("data.mdb")]  # nothing kept, no temporary left
    monkeypatch.undo()
    fs.put_file(str(new / "index.json"), f"{root}/index.json")
    copy = local_lmdb(url, opts, str(cache))
    assert Path(copy, "data.mdb").read_bytes() == (new / "data.mdb").read_bytes()


def test_packing_from_a_dead_endpoint_is_one_line(tmp_path: Path) -> None:
    flags = ["-o", "key=k", "-o", "secret=s", "-o", f"endpoint_url={dead_endpoint()}"]
    done = cli("pack", "s3://raw/photos", str(tmp_path / "out"), "-q", *flags)
    assert done.returncode == 1 and done.stderr.startswith("Error: s3://raw/photos"), done
    assert len(done.stderr.splitlines()) == 1 and "gave up after" in done.stderr, done.stderr


def test_an_s3_object_read_in_order_survives_cut_bodies(tmp_path: Path, packed: Path) -> None:
    """storage.open_read on S3 (an index's offsets file, an LMDB's data.mdb): a body cut
    short is asked again from where the last read ended, nothing lost nor repeated."""
    (tmp_path / "bkt").mkdir()
    os.symlink(packed, tmp_path / "bkt" / "ds")
    _CutShort.cut.clear()
    with serving(functools.partial(_CutShort, directory=str(tmp_path))) as base:
        opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": base}}
        with storage.open_read("s3://bkt/ds/shard-000000.tar", opts) as f:
            got = b"".join(iter(lambda: f.read(1000), b""))
    assert got == (packed / "shard-000000.tar").read_bytes() and len(_CutShort.cut) > 1


def test_s3_over_tls_trusts_aws_ca_bundle(tmp_path: Path, packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An endpoint whose certificate a private CA signed: trusted where AWS_CA_BUNDLE names the
    CA, as botocore trusts it; else refused, naming the URL and the reason."""
    (tmp_path / "bkt").mkdir()
    os.symlink(packed, tmp_path / "bkt" / "ds")
    tls = self_signed(tmp_path)
    with serving(functools.partial(_Ranges, directory=str(tmp_path)), tls=tls) as base:
        opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": base}}
        monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
        with pytest.raises(ShardkitError, match=r"^s3://bkt/ds/index\.json: .*CERTIFICATE_VERIFY_FAILED"):
            StreamingDataset("s3://bkt/ds", storage_options=opts)
        monkeypatch.setenv("AWS_CA_BUNDLE", tls[0])  # other options: connections made after it is set
        opts["client_kwargs"]["region_name"] = "eu-north-1"
        got = {s["__key__"]: s["jpg"] for s in StreamingDataset("s3://bkt/ds", storage_options=opts)}
    assert got == {s["__key__"]: s["jpg"] for s in StreamingDataset(str(packed))}


class _Versioned(_CutShort):
    """_CutShort with an ETag (the file's size and mtime) and If-Match honoured (412), as S3."""

    def _etag(self) -> str:
        st = os.stat(self.translate_path(self.path))
        return f'"{st.st_size}-{st.st_mtime_ns}"'

    def do_GET(self) -> None:
        if self.headers.get("If-Match") not in (None, self._etag()):
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()

    def end_headers(self) -> None:
        if self.command == "GET":
            self.send_header("ETag", self._etag())
        super().end_headers()


class _RangesOnce(_CutShort):
    """_CutShort whose second answer for a path ignores its range (the whole file, 200)."""

    def do_GET(self) -> None:
        if any(path == self.path for path, _ in self.cut):
            http.server.SimpleHTTPRequestHandler.do_GET(self)
        else:
            super().do_GET()


@pytest.mark.parametrize("server", [_Versioned, _RangesOnce])
def test_an_s3_object_read_in_order_never_mixes_bytes(server: type, tmp_path: Path) -> None:
    """After a cut body, the rest is asked for If-Match the first answer's ETag: an object
    replaced meanwhile fails (412), as does a server that answers the rest with the whole
    object, rather than reading as two versions spliced or its first bytes twice."""
    (tmp_path / "bkt").mkdir()
    obj = tmp_path / "bkt" / "obj"
    obj.write_bytes(os.urandom(200_000))
    _CutShort.cut.clear()
    with serving(functools.partial(server, directory=str(tmp_path))) as base:
        opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": base}}
        with storage.open_read("s3://bkt/obj", opts) as f:
            assert f.read(1000) == obj.read_bytes()[:1000]
            if server is _Versioned:
                obj.write_bytes(os.urandom(200_000))  # another version, under the same name
                os.utime(obj, ns=(1, 1))
            with pytest.raises(
                ShardkitError,
                match=r"^s3://bkt/obj: HTTP (412: replaced while it was read|400: the server ignored the range)",
            ):
                while f.read(1000):
                    pass
