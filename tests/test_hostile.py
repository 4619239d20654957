"""Hostile input and concurrent writers (issue 40): each case built from a generated input or a
real server on loopback, refused in one line naming the shard, file or URL, with no secret in
any message or chained traceback."""

from __future__ import annotations

import functools
import os
import shutil
import socket
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
from shardkit.errors import CorruptShardError, ShardkitError
from shardkit.reading.tar_dataset import TarDataset

from readers import WARNINGS
from servers import serving
from test_storage_errors import _Ranges

pytestmark = WARNINGS


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
