"""Hostile input and concurrent writers (issue 40): each case built from a generated input or a
real server on loopback, refused in one line naming the shard, file or URL, with no secret in
any message or chained traceback."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import struct
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pytest

import shardkit
from shardkit import StreamingDataset, storage
from shardkit.errors import CorruptShardError, DestinationBusyError, ShardkitError
from shardkit.reading.tar_dataset import TarDataset

from conftest import make_folder
from readers import WARNINGS
from servers import serving
from test_storage_errors import _Ranges

pytestmark = WARNINGS


# -- exclusive writers on object stores: conditional writes and DEST's lease ---------------------

@pytest.fixture(params=["local", "s3", "gcs"])
def conditional(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict | None]:
    """(folder URL, storage options) on each store with conditional writes; GCS through a gate
    of GCS's precondition rules (servers._Preconditions), which the emulator ignores."""
    if request.param == "local":
        return str(tmp_path / "dest"), None
    remote = request.getfixturevalue("s3" if request.param == "s3" else "gcs_conditional")
    return remote["url"] + "/dest", remote["storage_options"]


def test_conditional_writes_succeed_only_at_the_version_seen(conditional: tuple[str, dict | None]) -> None:
    from shardkit.storage.stores import store_for

    folder, opts = conditional
    storage.makedirs(folder, opts)
    url = folder + "/x"
    store = store_for(url, opts)
    assert store.conditional_writes and store.read_versioned(url) is None
    first = store.put_if_absent(url, b"one")
    assert first is not None and store.put_if_absent(url, b"two") is None
    assert store.read_versioned(url) == (b"one", first)
    second = store.replace_if(url, b"three", first)
    assert second is not None and second != first
    assert store.replace_if(url, b"four", first) is None and store.remove_if(url, first) is False
    assert store.read_versioned(url) == (b"three", second)
    assert store.remove_if(url, second) is True and store.read_versioned(url) is None
    assert store.replace_if(url, b"five", second) is None and store.remove_if(url, second) is False
    assert store.read_versioned(url) is None


@pytest.fixture(params=["s3", "gcs"])
def bucket(request: pytest.FixtureRequest) -> tuple[str, dict]:
    """(DEST URL, storage options) in a bucket of each object store with conditional writes."""
    remote = request.getfixturevalue("s3" if request.param == "s3" else "gcs_conditional")
    return remote["url"] + "/ds", remote["storage_options"]


# A pack in another process that stops before its commit (once every shard is in place) until
# a line comes on its stdin: a pack under way, for as long as a test needs one.
_PAUSED = """import json, sys
import shardkit
from shardkit import index
pinned = index.pinned
def paused(*args, **kwargs):
    print("paused", flush=True)
    sys.stdin.readline()
    return pinned(*args, **kwargs)
index.pinned = paused
shardkit.pack(sys.argv[1], sys.argv[2], max_count=4, workers=1, progress=False, storage_options=json.loads(sys.argv[3]))
print("packed", flush=True)
"""


def _paused_pack(src: Path, dest: str, opts: dict, **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED, str(src), dest, json.dumps(opts)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **env})
    assert proc.stdout is not None and proc.stdout.readline() == "paused\n", proc.communicate(timeout=60)
    return proc


def _go_on(proc: subprocess.Popen[str]) -> tuple[str, str]:
    out, err = proc.communicate("\n", timeout=120)
    return out, err


def _lock_note(dest: str, opts: dict) -> dict | None:
    from shardkit.storage.stores import store_for

    found = store_for(dest + "/.shardkit-lock", opts).read_versioned(dest + "/.shardkit-lock")
    return None if found is None else json.loads(found[0])


def test_a_second_pack_into_a_bucket_is_refused_naming_the_first(bucket: tuple[str, dict], photos: Path,
                                                                 tmp_path: Path) -> None:
    """Issue 40: a remote DEST had no lock, so two packs into one prefix replaced each other's
    shards. The lock object is created conditionally (If-None-Match: * / ifGenerationMatch=0)
    and names its holder; a second pack fails at once, before it writes anything."""
    dest, opts = bucket
    other = make_folder(tmp_path / "other", per_class=2)
    first = _paused_pack(photos, dest, opts)
    try:
        note = _lock_note(dest, opts)
        assert note is not None and note["pid"] == first.pid and note["lease_s"] == 120
        said = (rf"{re.escape(dest)}: another pack is writing into it \(run {note['run'][:12]}, pid {first.pid} on "
                rf"{re.escape(socket.gethostname())}, since [-+:T\d]+; it holds {re.escape(dest)}/\.shardkit-lock\): "
                r"wait for it to end, or pack into another prefix; it was refreshed \d+ s ago: a pack that died is "
                r"taken over once its lease has run out, in \d+ s")
        with pytest.raises(DestinationBusyError, match=rf"^{said}$"):
            shardkit.pack(str(other), dest, workers=1, progress=False, storage_options=opts)
    finally:
        out, err = _go_on(first)
    assert first.returncode == 0 and out == "packed\n", err
    assert _lock_note(dest, opts) is None  # let go as it ended
    assert shardkit.verify(dest, storage_options=opts) == []
    assert shardkit.index.load(dest, opts).samples == 30  # the first pack's, whole


def test_a_lock_not_refreshed_for_its_lease_is_taken_over(bucket: tuple[str, dict], photos: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A holder that stops refreshing (stopped here with SIGSTOP, as a machine that froze or
    lost its network) loses its lock once its lease has run out: the next pack takes it over by
    a conditional replace; the old holder, woken, finds it gone and stops before its commit."""
    dest, opts = bucket
    first = _paused_pack(photos, dest, opts, SHARDKIT_LOCK_LEASE_S="1.5")
    os.kill(first.pid, signal.SIGSTOP)
    try:
        time.sleep(2.0)  # a lease and more since its last refresh (every 0.375 s)
        with caplog.at_level(logging.WARNING, logger="shardkit"):
            assert shardkit.pack(str(photos), dest, max_count=4, workers=1, progress=False,
                                 storage_options=opts).samples == 30
    finally:
        os.kill(first.pid, signal.SIGCONT)
        _, err = _go_on(first)
    (took,) = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert re.fullmatch(rf"{re.escape(dest)}: took over the lock of a pack gone \(run \w+, pid {first.pid} on .*; "
                        r"not refreshed for \d+ s, over its lease of 2 s\)", took), took
    assert first.returncode == 1 and re.search(rf"DestinationBusyError: {re.escape(dest)}: another pack took this "
                                               r"pack's lock over \(.*\) after 2 s without a refresh", err), err
    assert _lock_note(dest, opts) is None and shardkit.verify(dest, storage_options=opts) == []


def test_a_killed_pack_into_a_bucket_is_rerun_at_once(bucket: tuple[str, dict], photos: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A pack killed with SIGKILL leaves its lock object behind; a rerun on the same machine
    sees that its holder's process has ended (boot id, pid namespace, pid and start time) and
    takes it over at once, keeping the killed pack's finished shards."""
    dest, opts = bucket
    first = _paused_pack(photos, dest, opts)
    first.kill()
    first.communicate(timeout=60)  # reaped: no zombie left to look alive
    note = _lock_note(dest, opts)
    assert note is not None and note["pid"] == first.pid
    stats: dict[str, int] = {}
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        idx = shardkit.pack(str(photos), dest, max_count=4, workers=1, progress=False, storage_options=opts,
                            stats=stats)
    assert idx.samples == 30 and stats["kept"] == 30 and stats["written"] == 0  # its shards were all in place
    assert any(f"its process {first.pid} on this machine has ended" in r.getMessage() for r in caplog.records)
    assert _lock_note(dest, opts) is None and shardkit.verify(dest, storage_options=opts) == []


def test_two_packs_taking_over_one_stale_lock_never_both_win(conditional: tuple[str, dict | None]) -> None:
    """Both read the stale lock, then both replace it conditionally on the version read: one
    succeeds, the other finds the winner's lock and is refused. (Not run on moto: its server
    checks a condition and writes in two steps, not atomically; S3 itself is atomic.)"""
    from shardkit.packing.lock import Lease
    from shardkit.storage.stores import store_for

    folder, opts = conditional
    if folder.startswith("s3://"):
        pytest.skip("moto checks If-Match and writes in two steps: a race between two writers is not its to settle")
    storage.makedirs(folder, opts)
    url = folder + "/.shardkit-lock"
    store = store_for(url, opts)
    stale = {"run": "0" * 32, "pid": 1, "host": "elsewhere", "since": "2026-01-01T00:00:00+0000",
             "lease_s": 60.0, "refreshed": time.time() - 600}
    assert store.put_if_absent(url, json.dumps(stale).encode()) is not None
    both_read = threading.Barrier(2, timeout=30)
    read = store.read_versioned
    first_read: set[int] = set()

    def read_then_wait(u: str) -> tuple[bytes, str] | None:
        found = read(u)
        if threading.get_ident() not in first_read:  # each taker's first look: both see the stale lock
            first_read.add(threading.get_ident())
            both_read.wait()
        return found

    store.read_versioned = read_then_wait  # type: ignore[method-assign]
    outcomes: list[Any] = []

    def take() -> None:
        lease = Lease(store, url, folder, 60.0)
        try:
            lease.take()
            outcomes.append(lease)
        except DestinationBusyError as e:
            outcomes.append(e)

    takers = [threading.Thread(target=take) for _ in range(2)]
    for t in takers:
        t.start()
    for t in takers:
        t.join(60)
    (won,) = [o for o in outcomes if isinstance(o, Lease)]
    (lost,) = [o for o in outcomes if isinstance(o, DestinationBusyError)]
    assert f"run {won.note['run'][:12]}" in str(lost)
    assert json.loads(read(url)[0])["run"] == won.note["run"]  # type: ignore[index]
    won.release()
    assert read(url) is None


# -- shards behind presigned or plain HTTPS URLs: versions recorded and checked -----------------

SIGNED = "?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAFAKE%2F20260101%2Fus-east-1%2Fs3%2Faws4_request" \
         "&X-Amz-Signature=" + "5e" * 32


class _Tagged(_Ranges):
    """A static file server with ranges that sends an ETag, as nginx does (from the file's
    modification time and size); _Ranges alone sends only Last-Modified (to a HEAD)."""

    def end_headers(self) -> None:
        path = self.translate_path(self.path)
        if os.path.isfile(path):
            st = os.stat(path)
            self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')
        super().end_headers()


def _replace_in_place(shard: Path) -> None:
    """Rewrite a shard with one byte of its first member's data changed, at the same size (its
    tar headers and offsets all still hold: nothing but its version tells), a minute later."""
    data = bytearray(shard.read_bytes())
    data[512 + 100] ^= 0xFF  # inside the first member's data (its header is the first 512 bytes)
    shard.write_bytes(bytes(data))
    later = shard.stat().st_mtime + 60
    os.utime(shard, (later, later))


@pytest.mark.parametrize("reader", ["stream", "map"])
@pytest.mark.parametrize("handler", [_Ranges, _Tagged], ids=["last-modified", "etag"])
def test_a_shard_replaced_behind_its_signed_url_is_named_at_its_first_read(
        packed: Path, tmp_path: Path, handler: type[_Ranges], reader: str) -> None:
    """Issue 40, fail 6: a list of presigned HTTPS URLs recorded no version, so a shard
    replaced behind its URL was read silently. Its version (ETag, else Last-Modified) is taken
    as the dataset is made, and checked as a reader first opens the shard."""
    www = tmp_path / "www" / "ds"
    shutil.copytree(packed, www)
    for p in www.iterdir():
        if not p.name.endswith(".tar"):
            p.unlink()  # a bucket's other objects are not signed for: the list's shards are scanned
    names = sorted(p.name for p in www.iterdir())
    with serving(functools.partial(handler, directory=str(tmp_path / "www"))) as base:
        urls = [f"{base}/ds/{n}{SIGNED}" for n in names]
        ds: Any = StreamingDataset(urls, shuffle=False) if reader == "stream" else TarDataset(urls)
        assert all(s.version is not None and set(s.version) == {"etag" if handler is _Tagged else "last_modified"}
                   for s in ds.index.shards)
        _replace_in_place(www / names[1])
        first = ds.index.shards[0].samples
        got: list[str] = []
        with pytest.raises(CorruptShardError, match=rf"/ds/{names[1]}\?\*\*\*: changed since its index was made") as e:
            for i, sample in enumerate(ds if reader == "stream" else (ds[i] for i in range(len(ds)))):
                got.append(sample["__url__"])
                assert i < first, "a sample of the replaced shard was read"
        assert "5e5e" not in str(e.value) and len(got) == first


# -- no secret in any message, repr or chained traceback -----------------------------------------

# Recognisable fake credentials, assembled so that no line of code a traceback quotes holds one
_FAKE = {name: f"FAKE{name.upper()}" + "7" * 12 for name in ("cred", "sig", "session", "key", "secret", "token")}
PRESIGNED = (f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={_FAKE['cred']}%2F20260101%2Fus-east-1%2Fs3"
             f"%2Faws4_request&X-Amz-Security-Token={_FAKE['session']}&X-Amz-Signature={_FAKE['sig']}")
CREDENTIALS = {"key": _FAKE["key"], "secret": _FAKE["secret"], "token": _FAKE["token"]}
FAULTS = ["refused", "403", "404", "500", "reset", "silent"]


def _every_text(e: BaseException | None, seen: set[int] | None = None) -> str:
    """Everything an error shows anywhere: each error of its chain (causes and contexts, the
    suppressed ones too) formatted with its traceback, its repr and its args."""
    seen = set() if seen is None else seen
    if e is None or id(e) in seen:
        return ""
    seen.add(id(e))
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__, chain=False)) + repr(e) + repr(e.args)
    return text + _every_text(e.__cause__, seen) + _every_text(e.__context__, seen)


def _raised(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - whatever it is, it is looked at
        return e
    raise AssertionError("no error")


def _no_secret_in(e: BaseException, names: str) -> None:
    assert isinstance(e, ShardkitError), _every_text(e)
    assert names in str(e) and len(str(e).splitlines()) == 1, str(e)
    text = _every_text(e)
    assert not [v for v in _FAKE.values() if v in text], text


class _Faulty(_Ranges):
    """A static file server with ranges that, once `fault` is set, answers every request with
    it: an HTTP status (with S3's XML error), a reset (RST), or silence."""

    fault: ClassVar[str] = ""

    def do_GET(self) -> None:
        if not self.fault:
            return super().do_GET()
        if self.fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        if self.fault == "silent":
            time.sleep(1.5)  # past the client's timeout
            self.close_connection = True
            return
        code = {"403": "AccessDenied", "404": "NoSuchKey", "500": "InternalError"}[self.fault]
        body = f"<Error><Code>{code}</Code><Message>{code}</Message></Error>".encode()
        self.send_response(int(self.fault))
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        if not self.fault:
            return super().do_HEAD()
        self.do_GET()

    do_PUT = do_POST = do_DELETE = do_GET


@pytest.fixture
def faulty(tmp_path: Path, packed: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The base URL of a _Faulty server over a folder holding the packed dataset as ds/ and as
    the S3 bucket bucket/ds (no fault set yet); retries cut to 2 attempts."""
    from shardkit.storage import retry

    monkeypatch.setattr(retry, "RETRIES", 2)
    monkeypatch.setattr(retry, "OUTAGE_RETRIES", 2)
    (tmp_path / "www" / "bucket").mkdir(parents=True)
    os.symlink(packed, tmp_path / "www" / "ds")
    os.symlink(packed, tmp_path / "www" / "bucket" / "ds")
    _Faulty.fault = ""
    try:
        with serving(functools.partial(_Faulty, directory=str(tmp_path / "www"))) as base:
            yield base
    finally:
        _Faulty.fault = ""


def _dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


_QUICK = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_connect=0.5, sock_read=0.5)}}


@pytest.mark.parametrize("fault", FAULTS)
def test_no_secret_of_a_presigned_url_in_any_error(faulty: str, fault: str) -> None:
    """Issue 40, fail 7: a refused connection to a presigned URL was raised `from` fsspec's
    FileNotFoundError(url), so every printed traceback showed X-Amz-Credential, -Security-Token
    and -Signature. Every lower layer's error is now a cause redacted of them (RedactedError),
    with no raw one left as a context either: each remote fault, each way in."""
    base = _dead_endpoint() if fault == "refused" else faulty
    signed = f"{base}/ds/shard-000000.tar{PRESIGNED}"
    ready = StreamingDataset([f"{faulty}/ds/shard-000000.tar{PRESIGNED}"], storage_options=_QUICK, shuffle=False)
    mapped = TarDataset([f"{faulty}/ds/shard-000001.tar{PRESIGNED}"], storage_options=_QUICK)
    _Faulty.fault = fault
    calls: list[Callable[[], Any]] = [
        lambda: storage.read_bytes(signed, _QUICK),
        lambda: storage.read_range(signed, 0, 100, _QUICK),
        lambda: StreamingDataset([signed], storage_options=_QUICK),
        lambda: TarDataset([signed], storage_options=_QUICK),
        lambda: next(iter(ready)),  # a dataset made while the server answered: its reads fail
        lambda: mapped[0],
    ]
    for call in calls:
        e = _raised(call)
        _no_secret_in(e, "/ds/shard-00000")
        assert "?***" in str(e)


@pytest.mark.parametrize("fault", FAULTS)
def test_no_secret_of_s3_credentials_in_any_error(faulty: str, fault: str, photos: Path) -> None:
    """The storage options' key, secret and session token (which shardkit's presigned GETs
    put in their URLs) stay out of every error too: reading, listing, packing."""
    base = _dead_endpoint() if fault == "refused" else faulty
    opts = {**CREDENTIALS, "client_kwargs": {"endpoint_url": base},
            "config_kwargs": {"connect_timeout": 0.5, "read_timeout": 0.5}, "skip_instance_cache": True}
    _Faulty.fault = fault
    calls: list[tuple[Callable[[], Any], str]] = [
        (lambda: storage.read_bytes("s3://bucket/ds/index.json", opts), "s3://bucket/ds/index.json"),
        (lambda: StreamingDataset("s3://bucket/ds", storage_options=opts), "s3://bucket/ds"),
        (lambda: StreamingDataset(["s3://bucket/ds/shard-000000.tar"], storage_options=opts), "shard-000000.tar"),
        (lambda: shardkit.verify("s3://bucket/ds", storage_options=opts), "s3://bucket/ds"),
        (lambda: shardkit.pack(str(photos), "s3://bucket/out", workers=1, progress=False, storage_options=opts),
         "s3://bucket/out"),
    ]
    for call, names in calls:
        _no_secret_in(_raised(call), names)


def test_no_secret_in_the_repr_of_a_pack_plan(photos: Path, tmp_path: Path) -> None:
    """A pack's plan and each of its jobs carry the storage options (to every worker): their
    reprs leave them out."""
    from shardkit.packing.plan import make_plan

    plan = make_plan(str(photos), str(tmp_path / "out"), storage_options=CREDENTIALS)
    assert plan.storage_options == CREDENTIALS
    assert not [v for v in _FAKE.values() if v in repr(plan) + repr(plan.job(0))]
