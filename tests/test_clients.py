"""The S3 clients a user may choose (`storage_options={"client": ...}`, stores/choice.py), each
against moto: ranged reads, a replaced shard refused, credentials, endpoint, region and
addressing as the presigned path sends them, resets retried without a sample lost, and no
Rust runtime started in the main process before DataLoader forks its workers."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import urlsplit

import fsspec
import pytest
from torch.utils.data import DataLoader

import shardkit.storage.retry

from shardkit import StreamingDataset, index
from shardkit.errors import BadRequestError, CorruptShardError
from shardkit.storage import s3_http
from shardkit.storage.stores import store_for
from shardkit.storage.streams import Arriving

import servers

NATIVE = ["obstore"]
RUNTIMES = {"obstore": "obstore"}
NAMES = {"obstore": "s3 (obstore)"}


@pytest.fixture(autouse=True)
def _credentials_in_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """moto's credentials in AWS_*, nothing else of AWS's."""
    for name in [k for k in os.environ if k.startswith(("AWS_", "FSSPEC_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def upload(s3: dict, packed: Path, name: str = "ds") -> tuple[str, dict]:
    """The packed dataset in the bucket, its index pinned to the bucket's ETags: (URL, options)."""
    url, opts = f"{s3['url']}/{name}", s3["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    index.save(index.pinned(index.load(url, opts), url, opts), url, opts)
    return url, opts


def keys(ds: StreamingDataset, workers: int) -> list[str]:
    return [k for batch in DataLoader(ds, batch_size=16, num_workers=workers) for k in batch["__key__"]]


@pytest.mark.parametrize("client", NATIVE)
def test_ranged_reads(client: str, s3: dict) -> None:
    """A range, one that runs past the object's end (its bytes up to the end), one that starts
    past it (416, as every store's get raises it)."""
    data = os.urandom(3 << 20)
    fs, _ = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    fs.pipe(f"{s3['url']}/o.bin", data)
    url = f"{s3['url']}/o.bin"
    store = store_for(url, {**s3["storage_options"], "client": client})
    assert store.name == NAMES[client]
    pin = {"etag": fs.info(url)["ETag"]}
    for start, stop in ((0, 1), (12345, 2_000_000), (len(data) - 10, len(data) + 100)):
        sink = Arriving(start, stop)
        size = store.get(url, start, stop, sink, pin)
        assert bytes(sink.pieces[0]._view[: sink.filled]) == data[start:stop]
        assert size in (None, len(data))
    with pytest.raises(s3_http.HTTPStatusError) as past:
        store.get(url, len(data) + 10, len(data) + 20, Arriving(len(data) + 10, len(data) + 20), pin)
    assert past.value.status == 416


@pytest.mark.parametrize("client", NATIVE)
def test_a_replaced_shard_is_refused_naming_it(client: str, s3: dict, packed: Path) -> None:
    """obstore's GETs carry If-Match (412 from moto): the shard named."""
    url, opts = upload(s3, packed)
    name = index.load(url, opts).shards[2].name
    fs, root = fsspec.core.url_to_fs(url, **opts)
    data = bytearray(fs.cat_file(f"{root}/{name}"))
    data[-1030] ^= 1
    fs.pipe(f"{root}/{name}", bytes(data))
    ds = StreamingDataset(url, storage_options={**opts, "client": client})
    with pytest.raises(CorruptShardError, match=rf"{url}/{name}: changed since its index was made"):
        keys(ds, 0)


@pytest.mark.parametrize("client", NATIVE)
def test_an_epoch_in_forked_workers_starts_no_runtime_before_the_fork(client: str, s3: dict, packed: Path) -> None:
    """The main process reads the index, len() and a sample's metadata, then DataLoader forks
    two workers: every sample once, read by the chosen client (stats() names it), and the
    client's module not even imported in the main process (its runtime starts in the workers)."""
    url, opts = upload(s3, packed)
    code = (
        "import json, sys\n"
        "from torch.utils.data import DataLoader\n"
        "import shardkit\n"
        "ds = shardkit.StreamingDataset(sys.argv[1], storage_options=json.loads(sys.argv[2]), shuffle=True)\n"
        "n = len(ds)\n"
        "got = [k for b in DataLoader(ds, batch_size=16, num_workers=2) for k in b['__key__']]\n"
        "print(json.dumps([n, len(got), len(set(got)), ds.stats()['store'], sys.argv[3] in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, url, json.dumps({**opts, "client": client}), RUNTIMES[client]],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [120, 120, 120, NAMES[client], False]


@pytest.mark.parametrize("client", NATIVE)
def test_a_client_used_before_a_fork_fails_in_the_child_rather_than_hang(client: str, s3: dict, packed: Path) -> None:
    """obstore's runtime does not survive a fork (its child hangs: forks.py):
    a pass in the main process, then DataLoader workers forked from it, fail at their first
    read with a line that says so. In a fresh process: this one may have used either."""
    url, opts = upload(s3, packed)
    code = (
        "import json, sys\n"
        "from torch.utils.data import DataLoader\n"
        "import shardkit\n"
        "ds = shardkit.StreamingDataset(sys.argv[1], storage_options=json.loads(sys.argv[2]))\n"
        "assert len(list(ds)) == 120\n"
        "try:\n"
        "    list(DataLoader(ds, batch_size=16, num_workers=2))\n"
        "except shardkit.ShardkitError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, url, json.dumps({**opts, "client": client})],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert done.returncode == 0, done.stderr
    assert f"client={client!r}: this process was forked from one that had already read through {client}" in done.stdout


def _signed(request: BaseHTTPRequestHandler) -> dict:
    """What a request to moto carried: method, path, Host, the signature's key and region, If-Match."""
    auth = request.headers.get("Authorization", "")
    credential = auth.split("Credential=", 1)[1].split(",", 1)[0].split("/") if "Credential=" in auth else []
    return {
        "method": request.command,
        "path": request.path,
        "host": request.headers.get("Host"),
        "key": credential[0] if credential else None,
        "region": credential[2] if credential else None,
        "if_match": request.headers.get("If-Match"),
    }


def recording(upstream: str) -> contextlib.AbstractContextManager[tuple[str, list[dict]]]:
    return servers.recording(upstream, _signed)


@pytest.mark.parametrize("client", NATIVE)
@pytest.mark.parametrize("credentials", ["options", "environment", "profile"])
def test_credentials_endpoint_region_and_addressing(
    client: str,
    credentials: str,
    s3: dict,
    s3_server: str,
    packed: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each client signs the shards' GETs with the key the options, AWS_* variables or a
    profile give, for the options' region, path-style on the options' endpoint (as botocore
    and the presigned path address an S3-compatible store)."""
    url, opts = upload(s3, packed)
    opts = {k: v for k, v in opts.items() if k not in ("key", "secret")}
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    if credentials == "options":
        opts.update(key="testing", secret="testing")
    elif credentials == "environment":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    else:
        (tmp_path / "no-credentials").write_text(
            "[train]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
        )
        opts["profile"] = "train"
    with recording(s3_server) as (base, seen):
        chosen = {**opts, "client": client, "client_kwargs": {"endpoint_url": base, "region_name": "eu-west-3"}}
        got = keys(StreamingDataset(url, storage_options=chosen, shuffle=True), 0)
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    shards = [r for r in seen if r["path"].split("?")[0].endswith(".tar")]
    assert shards and all(r["key"] == "testing" and r["region"] == "eu-west-3" for r in shards)
    assert all(r["path"].startswith("/shardkit-test/ds/") and r["host"] == urlsplit(base).netloc for r in shards)
    gets = [r for r in shards if r["method"] == "GET"]
    if client == "obstore":
        assert gets and all(r["if_match"] for r in gets)


@pytest.mark.parametrize("client", NATIVE)
def test_refused_credentials_fail_at_once_naming_the_shard(client: str, forbidding: tuple[str, list[str]]) -> None:
    """A store answering 403 to every request: the shard's read fails as AccessDeniedError
    naming it, after one request, not after the retries."""
    from shardkit.errors import AccessDeniedError
    from shardkit.storage.range_reader import RangeReader

    base, log = forbidding
    url = "s3://bkt/ds/shard-000000.tar"
    reader = RangeReader(
        [url], {"key": "testing", "secret": "testing", "client": client, "client_kwargs": {"endpoint_url": base}}
    )
    try:
        with pytest.raises(AccessDeniedError, match=rf"{url} \(bytes 0-10\)"):
            reader.read(0, 0, 10)
    finally:
        reader.close()
    assert len(log) == 1


def test_two_datasets_sign_with_their_own_credentials(s3: dict, s3_server: str) -> None:
    """One bucket and endpoint read with two sets of options: obstore signs each one's GETs
    with its own key, never with the first one's."""
    fs, _ = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    fs.pipe(f"{s3['url']}/o.bin", b"x" * 1000)
    with recording(s3_server) as (base, seen):
        for key in ("first", "second"):
            opts = {"key": key, "secret": "s", "client": "obstore", "client_kwargs": {"endpoint_url": base}}
            sink = Arriving(0, 10)
            store_for(f"{s3['url']}/o.bin", opts).get(f"{s3['url']}/o.bin", 0, 10, sink, None)
            assert sink.filled == 10
    assert [r["key"] for r in seen] == ["first", "second"]


@pytest.mark.parametrize("client", NATIVE)
def test_resets_and_throttling_cost_no_sample(
    client: str,
    s3: dict,
    s3_server: str,
    packed: Path,  # type: ignore[no-untyped-def]
    latency_proxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fifth of the responses reset part-way and a fifth of the GETs answered 503 SlowDown:
    every sample comes once. obstore's GET fails raw and the reader asks for the rest (after
    a backoff, counted as throttling, for a 503)."""
    monkeypatch.setattr(shardkit.storage.patience, "OUTAGE_RETRIES", 10)
    url, opts = upload(s3, packed)
    proxied, control = latency_proxy(s3_server, latency_ms=2, seed=5)
    chosen = {**opts, "client": client, "client_kwargs": {"endpoint_url": proxied}}
    ds = StreamingDataset(url, storage_options=chosen, shuffle=True, block=4)
    control.set("reset_prob", 0.2)
    control.set("reset_max_bytes", 2_000)
    control.storm(600, 0.2)
    got = keys(ds, 0)  # in this process: a worker forked from it could use neither client (forks.py)
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    assert control.stats()["resets"] > 0 and control.stats()["throttled"] > 0
    assert ds.stats()["throttled"] > 0


def test_a_pack_into_the_bucket_takes_the_option_too(s3: dict, photos: Path) -> None:
    """The same options pack and read: `client` reaches no fsspec backend (s3fs writes)."""
    import shardkit

    opts = {**s3["storage_options"], "client": "obstore"}
    shardkit.pack(str(photos), f"{s3['url']}/p", max_count=10, workers=1, progress=False, storage_options=opts)
    ds = StreamingDataset(f"{s3['url']}/p", storage_options=opts)
    assert len(keys(ds, 0)) == 30 and ds.stats()["store"] == "s3 (obstore)"


def test_choices_refused_in_a_line(s3: dict) -> None:
    """An unknown client, a client for another scheme, options only botocore's client applies."""
    opts = s3["storage_options"]
    with pytest.raises(BadRequestError, match="unknown storage option client='curl'; choose from presigned"):
        store_for(f"{s3['url']}/x", {**opts, "client": "curl"})
    with pytest.raises(
        BadRequestError, match="az://b/x: storage option client='obstore' applies to s3:// and gs:// URLs only"
    ):
        store_for("az://b/x", {"client": "obstore"})
    with pytest.raises(BadRequestError, match=r"client='obstore' cannot apply the storage option\(s\) requester_pays"):
        store_for(f"{s3['url']}/x", {**opts, "client": "obstore", "requester_pays": True})
    assert store_for(f"{s3['url']}/x", {**opts, "client": "s3fs"}).name == "s3fs"
    assert store_for(f"{s3['url']}/x", {**opts, "client": "presigned"}).name == "s3 (presigned)"
    assert store_for(f"{s3['url']}/x", opts).name == "s3 (presigned)"  # the default


def test_a_stalled_store_through_obstore_is_three_stalls(
    s3: dict,
    s3_server: str,
    packed: Path,  # type: ignore[no-untyped-def]
    latency_proxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """obstore's timeout is a stall as the presigned path's is (patience.py): three silent
    tries, then one line naming the shard, not a dataset's ten attempts."""
    from shardkit.errors import ShardkitError

    monkeypatch.setattr(shardkit.storage.patience, "OUTAGE_RETRIES", 10)
    url, opts = upload(s3, packed, "stalled")
    proxied, control = latency_proxy(s3_server)
    chosen = {**opts, "client": "obstore", "timeout": 1, "client_kwargs": {"endpoint_url": proxied}}
    ds = StreamingDataset(url, storage_options=chosen, shuffle=False, prefetch=0)
    control.set("stall_prob", 1.0)
    with pytest.raises(
        ShardkitError,
        match=r"shard-000000\.tar \(bytes \d+-\d+\): TimeoutError: .*gave up after 3 "
        r"attempts; the storage options timeout= and attempts= set",
    ):
        keys(ds, 0)  # in this process: a worker forked from it could not use obstore (forks.py)
    control.set("stall_prob", 0.0)
    assert control.stats()["stalls"] == 3
