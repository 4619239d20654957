"""A request's timeout and attempts (storage/patience.py): set by the storage options and the
CLI's -o, a stalled store given up on in about a minute, a slow but moving body never cut
off, an outage still ridden out (issue 40)."""

from __future__ import annotations

import http.server
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

from servers import serving
from shardkit import StreamingDataset, storage
from shardkit.errors import BadRequestError, ShardkitError
from shardkit.storage import fetch
from shardkit.storage.stores import store_for


def test_a_stall_is_tried_three_times_an_outage_all_its_attempts() -> None:
    """A silent store fails a read after 3 timeouts; one that refuses or resets (a restart, an
    outage that may end) gets every attempt."""

    def failing(error: type[Exception]) -> Any:
        calls: list[int] = []

        def call() -> None:
            calls.append(1)
            raise error("no")

        return call, calls

    stall, stalls = failing(TimeoutError)
    with pytest.raises(
        ShardkitError,
        match=r"^s3://b/x\.tar: TimeoutError: no \(gave up after 3 attempts; the "
        r"storage options timeout= and attempts= set how long to wait\)$",
    ):
        storage.retrying("s3://b/x.tar", stall, attempts=10, base_s=0.001, stalls=3)
    reset, resets = failing(ConnectionResetError)
    with pytest.raises(ShardkitError, match=r"gave up after 10 attempts\)$"):
        storage.retrying("s3://b/x.tar", reset, attempts=10, base_s=0.001, stalls=3)
    assert (len(stalls), len(resets)) == (3, 10)


def test_the_defaults_and_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """20 s of silence and 5 attempts (10 for a dataset's reads); on GCS 5 s a try and
    gcsfs's own 6 tries; both options taken out of what the client is given."""
    from shardkit.storage import patience

    monkeypatch.setattr(patience, "OUTAGE_RETRIES", 10)  # the real count (conftest lowers it)
    s3 = storage.patience_for("s3://b/x", None)
    assert (s3.timeout_s, s3.attempts(), s3.attempts(patient=True), s3.stalls) == (20.0, 5, 10, 3)
    gcs = storage.patience_for("gs://b/x", None)
    assert (gcs.timeout_s, gcs.attempts(patient=True)) == (5.0, 1)
    mine = storage.patience_for("https://h/x", {"timeout": 2, "attempts": 2})
    assert (mine.timeout_s, mine.attempts(patient=True), mine.stalls) == (2.0, 2, 2)
    fs, _ = storage.filesystem("https://example.invalid/ds", {"timeout": 2.5, "attempts": 2})
    assert fs.client_kwargs["timeout"].sock_read == 2.5 and "attempts" not in fs.storage_options


@pytest.mark.parametrize(
    ("opts", "said"),
    [
        ({"timeout": 0}, "storage option timeout=0: expected seconds, a number above 0"),
        ({"timeout": "soon"}, "storage option timeout='soon': expected seconds, a number above 0"),
        ({"attempts": 0}, "storage option attempts=0: expected a whole number, 1 or more"),
        ({"attempts": 2.5}, "storage option attempts=2.5: expected a whole number, 1 or more"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_option(packed: Path, opts: dict, said: str) -> None:
    with pytest.raises(BadRequestError, match=f"^{said}$"):
        StreamingDataset(str(packed), storage_options=opts)
    out = subprocess.run(
        [sys.executable, "-m", "shardkit", "info", str(packed), *(f"-o{k}={v}" for k, v in opts.items())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (out.returncode, out.stderr) == (1, f"Error: {said}\n")


def test_a_stalled_s3_store_fails_a_read_after_three_timeouts_not_ten(
    s3: dict, s3_server: str, packed: Path, latency_proxy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: a store that stalls mid-read was given up on after 10 x 60 s. A dataset's
    reads still get 10 attempts (an outage), but three silent ones end the read."""
    from shardkit.storage import patience

    monkeypatch.setattr(patience, "OUTAGE_RETRIES", 10)  # the real count (conftest lowers it)
    fs, root = fsspec.core.url_to_fs(s3["url"] + "/stall", **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(s3_server)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}, "timeout": 1}
    ds = StreamingDataset(s3["url"] + "/stall", storage_options=opts, shuffle=False, prefetch=0)
    control.set("stall_prob", 1.0)
    with pytest.raises(
        ShardkitError,
        match=r"shard-000000\.tar \((bytes \d+-\d+|fingerprint)\): .*gave up after 3 attempts; the "
        r"storage options timeout= and attempts= set",
    ):
        next(iter(ds))
    assert control.stats()["stalls"] == 3
    control.set("stall_prob", 0.0)


def test_the_cli_sets_timeout_and_attempts(s3: dict, s3_server: str, packed: Path, latency_proxy: Any) -> None:
    """`-o timeout=1 -o attempts=2`: two silent tries of one second each, then one line. The
    index is an opening read, hedged (fetch.first_answer): each of its copies tries twice."""
    fs, root = fsspec.core.url_to_fs(s3["url"] + "/stall-cli", **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(s3_server)
    creds = [f"-o{k}={v}" for k, v in s3["storage_options"].items() if k in ("key", "secret")]
    control.set("stall_prob", 1.0)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardkit",
            "info",
            s3["url"] + "/stall-cli",
            *creds,
            f"-oendpoint_url={proxied}",
            "-otimeout=1",
            "-oattempts=2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    control.set("stall_prob", 0.0)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert "index.json" in out.stderr and "gave up after 2 attempts" in out.stderr
    assert 2 <= control.stats()["stalls"] <= 2 * fetch.ATTEMPTS


class _Trickle(http.server.BaseHTTPRequestHandler):
    """6,000 bytes of any object, 100 every 0.1 s: four times a 1.5 s timeout in all, but never
    silent for long (a ranged answer, as S3 and HTTP servers give)."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(206)
        self.send_header("Content-Length", "6000")
        self.send_header("Content-Range", "bytes 0-5999/6000")
        self.send_header("ETag", '"e"')
        self.end_headers()
        for _ in range(60):
            self.wfile.write(b"x" * 100)
            self.wfile.flush()
            time.sleep(0.1)


@pytest.mark.parametrize("store", ["s3", "https"])
def test_a_slow_but_moving_body_is_not_cut_off(store: str) -> None:
    """The deadline is on silence, not on the request: a body that takes 4x the timeout
    arrives whole, through the presigned S3 client and fsspec's HTTP one (GCS: test_remote)."""
    with serving(_Trickle) as endpoint:
        if store == "s3":
            url, opts = "s3://bucket/slow.tar", {"anon": True, "endpoint_url": endpoint, "timeout": 1.5}
            assert store_for(url, opts).name == "s3 (presigned)"
        else:
            url, opts = f"{endpoint}/slow.tar", {"timeout": 1.5}
        start = time.monotonic()
        assert storage.read_range(url, 0, 6000, opts) == b"x" * 6000
        assert time.monotonic() - start > 4.5  # it did take longer than the timeout, three times over
