"""The GCS clients a user may choose (`storage_options={"client": ...}` on gs://, stores/choice.py),
against fake-gcs-server: obstore's ranged reads, a replaced shard refused by its generation,
gcsfs's endpoint and credentials reaching obstore's GETs, resets retried by shardkit without
a sample lost, and no Rust runtime started in the main process before DataLoader forks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import fsspec
import pytest
from torch.utils.data import DataLoader

import shardkit.storage.patience
from shardkit import StreamingDataset, index
from shardkit.errors import BadRequestError, CorruptShardError, ShardkitError
from shardkit.storage import s3_http
from shardkit.storage.stores import store_for
from shardkit.storage.streams import Arriving

import servers


def upload(fakegcs: dict, packed: Path, name: str) -> tuple[str, dict]:
    """The packed dataset in the bucket under `name`, its index pinned to the objects'
    generations: (URL, options). A name a test of its own: this process's gcsfs clients keep
    their listings of the paths of earlier tests."""
    url, opts = f"{fakegcs['url']}/{name}", fakegcs["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    index.save(index.pinned(index.load(url, opts), url, opts), url, opts)
    return url, opts


def keys(ds: StreamingDataset) -> list[str]:
    return [k for batch in DataLoader(ds, batch_size=16, num_workers=0) for k in batch["__key__"]]


def test_ranged_reads(fakegcs: dict) -> None:
    """A range, one that runs past the object's end (its bytes up to the end), one that starts
    past it (416, as every store's get raises it), each of the pinned generation."""
    data = os.urandom(3 << 20)
    url = f"{fakegcs['url']}/o.bin"
    fs, _ = fsspec.core.url_to_fs(url, **fakegcs["storage_options"])
    fs.pipe(url, data)
    store = store_for(url, {**fakegcs["storage_options"], "client": "obstore"})
    assert store.name == "gcs (obstore)" and store.conditional
    pin = {"generation": str(fs.info(url)["generation"])}
    for start, stop in ((0, 1), (12345, 2_000_000), (len(data) - 10, len(data) + 100)):
        sink = Arriving(start, stop)
        assert store.get(url, start, stop, sink, pin) == len(data)
        assert sink.data() == data[start:stop]
    with pytest.raises(s3_http.HTTPStatusError) as past:
        store.get(url, len(data) + 10, len(data) + 20, Arriving(len(data) + 10, len(data) + 20), pin)
    assert past.value.status == 416


def test_a_replaced_shard_is_refused_naming_it(fakegcs: dict, packed: Path) -> None:
    """Each GET asks for the pinned generation: a shard replaced since (a new generation) is
    refused, named, with the generation the index has."""
    url, opts = upload(fakegcs, packed, "replaced")
    shard = index.load(url, opts).shards[2]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    data = bytearray(fs.cat_file(f"{root}/{shard.name}"))
    data[-1030] ^= 1
    fs.pipe(f"{root}/{shard.name}", bytes(data))
    ds = StreamingDataset(url, storage_options={**opts, "client": "obstore"})
    generation = shard.version["generation"]  # type: ignore[index]
    with pytest.raises(
        CorruptShardError,
        match=rf"{url}/{shard.name}: changed since its index was made "
        rf"\(its generation is no longer {generation}\)",
    ):
        keys(ds)


def _run(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_epoch_in_forked_workers_starts_no_runtime_before_the_fork(fakegcs: dict, packed: Path) -> None:
    """The main process reads the index and len() through gcsfs, then DataLoader forks two
    workers: every sample once, read by obstore (stats() names it), obstore not even
    imported in the main process."""
    url, opts = upload(fakegcs, packed, "forked")
    code = (
        "import json, sys\n"
        "from torch.utils.data import DataLoader\n"
        "import shardkit\n"
        "ds = shardkit.StreamingDataset(sys.argv[1], storage_options=json.loads(sys.argv[2]), shuffle=True)\n"
        "n = len(ds)\n"
        "got = [k for b in DataLoader(ds, batch_size=16, num_workers=2) for k in b['__key__']]\n"
        "print(json.dumps([n, len(got), len(set(got)), ds.stats()['store'], 'obstore' in sys.modules]))"
    )
    out = _run(code, url, json.dumps({**opts, "client": "obstore"}))
    assert json.loads(out) == [120, 120, 120, "gcs (obstore)", False]


def test_obstore_used_before_a_fork_fails_in_the_child_rather_than_hang(fakegcs: dict, packed: Path) -> None:
    """A pass in the main process starts obstore's runtime; DataLoader workers forked after it
    fail at their first read with a line that says so (forks.py)."""
    url, opts = upload(fakegcs, packed, "before")
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
    out = _run(code, url, json.dumps({**opts, "client": "obstore"}))
    assert "client='obstore': this process was forked from one that had already read through obstore" in out


def _authorized(request: BaseHTTPRequestHandler) -> dict:
    return {"method": request.command, "path": request.path, "auth": request.headers.get("Authorization")}


def recording(upstream: str) -> contextlib.AbstractContextManager[tuple[str, list[dict]]]:
    """A proxy in front of fake-gcs-server noting each request's method, path and Authorization."""
    return servers.recording(upstream, _authorized, upstream_host=True)


def test_gcsfs_endpoint_and_credentials_reach_obstores_gets(fakegcs: dict, fakegcs_server: str, packed: Path) -> None:
    """obstore's GETs go to the options' `endpoint_url`, signed with the token gcsfs holds (here
    an OAuth token given as google-auth credentials, as a user may give gcsfs one)."""
    from google.oauth2.credentials import Credentials

    url, _ = upload(fakegcs, packed, "signed")
    with recording(fakegcs_server) as (base, seen):
        opts = {
            "project": "test",
            "endpoint_url": base,
            "token": Credentials(token="sk-test-token"),
            "skip_instance_cache": True,
            "client": "obstore",
        }
        ds = StreamingDataset(url, storage_options=opts, shuffle=True)
        got = keys(ds)
    assert sorted(got) == sorted(set(got)) and len(got) == 120 and ds.stats()["store"] == "gcs (obstore)"
    shards = [
        r
        for r in seen
        if r["method"] == "GET"
        and "generation=" in r["path"]  # obstore's: the XML API's
        and r["path"].split("?")[0].endswith("%2Etar")
    ]
    assert shards and all(r["auth"] == "Bearer sk-test-token" for r in shards)


def test_two_datasets_sign_with_their_own_credentials(fakegcs: dict, fakegcs_server: str) -> None:
    """One bucket and endpoint read with two tokens: obstore signs each one's GETs with its own,
    never with the first one's (its stores are one a process, bucket and options)."""
    from google.oauth2.credentials import Credentials

    url = f"{fakegcs['url']}/o.bin"
    fs, _ = fsspec.core.url_to_fs(url, **fakegcs["storage_options"])
    fs.pipe(url, b"x" * 1000)
    with recording(fakegcs_server) as (base, seen):
        for token in ("first", "second", "first"):
            opts = {"project": "test", "endpoint_url": base, "token": Credentials(token=token), "client": "obstore"}
            sink = Arriving(0, 10)
            store_for(url, opts).get(url, 0, 10, sink, None)
            assert sink.filled == 10
    assert [r["auth"] for r in seen if r["path"].startswith("/shardkit%2Dtest/")] == [
        "Bearer first",
        "Bearer second",
        "Bearer first",
    ]


def test_resets_cost_no_sample(
    fakegcs: dict,
    fakegcs_server: str,
    packed: Path,  # type: ignore[no-untyped-def]
    latency_proxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fifth of the responses reset part-way: obstore's retries are off, shardkit's ask for
    the rest, and every sample comes once."""
    monkeypatch.setattr(shardkit.storage.patience, "OUTAGE_RETRIES", 10)
    url, opts = upload(fakegcs, packed, "resets")
    proxied, control = latency_proxy(fakegcs_server, latency_ms=2, seed=5)
    ds = StreamingDataset(
        url, storage_options={**opts, "endpoint_url": proxied, "client": "obstore"}, shuffle=True, block=4
    )
    control.set("reset_prob", 0.2)
    control.set("reset_max_bytes", 2_000)
    got = keys(ds)
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    assert control.stats()["resets"] > 0


def test_a_stalled_get_times_out_by_the_options_patience(
    fakegcs: dict,
    fakegcs_server: str,
    packed: Path,  # type: ignore[no-untyped-def]
    latency_proxy,
) -> None:
    """A store gone silent once the index is read: obstore's GETs give up after `timeout`
    seconds each, shardkit tries 3 times (its stalls), then one line names the shard."""
    url, opts = upload(fakegcs, packed, "stall")
    proxied, control = latency_proxy(fakegcs_server)
    ds = StreamingDataset(
        url,
        storage_options={**opts, "endpoint_url": proxied, "client": "obstore", "timeout": 1},
        shuffle=False,
        prefetch=0,
    )
    control.set("stall_prob", 1.0)
    try:
        with pytest.raises(ShardkitError, match=r"shard-000000\.tar \(bytes \d+-\d+\): .*gave up after 3 attempts"):
            next(iter(ds))
    finally:
        control.set("stall_prob", 0.0)
    assert control.stats()["stalls"] == 3


def test_choices_refused_in_a_line(fakegcs: dict) -> None:
    """A client not GCS's, a GCS client for another scheme, options obstore's GETs cannot carry;
    gcsfs the default, by name or not."""
    opts, url = fakegcs["storage_options"], f"{fakegcs['url']}/x"
    with pytest.raises(
        BadRequestError,
        match=rf"{url}: unknown storage option client='s3fs'; choose from gcsfs, "
        "obstore",
    ):
        store_for(url, {**opts, "client": "s3fs"})
    with pytest.raises(BadRequestError, match="az://c/x: storage option client='gcsfs' applies to s3:// and gs://"):
        store_for("az://c/x", {"client": "gcsfs"})
    with pytest.raises(
        BadRequestError,
        match=rf"{url}: storage option client='obstore' cannot apply the storage "
        r"option\(s\) requester_pays; client='gcsfs' can",
    ):
        store_for(url, {**opts, "client": "obstore", "requester_pays": True})
    assert store_for(url, {**opts, "client": "gcsfs"}).name == "gcs (gcsfs)"
    assert store_for(url, opts).name == "gcs (gcsfs)"  # the default
