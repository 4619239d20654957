"""Object stores as they are, against moto's S3 server, the GCS emulator and the fault proxy:
throttling (503 SlowDown) and resets that must cost no sample, and shards replaced under
their names, which the index's versions catch at their first read."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import fsspec
import pytest
from torch.utils.data import DataLoader

import shardkit
import shardkit.storage.s3_http
from shardkit import StreamingDataset, index
from shardkit.cli import main
from shardkit.errors import CorruptShardError


def keys(ds: StreamingDataset, workers: int = 0) -> list[str]:
    return [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=workers)]


def test_throttling_and_resets_cost_no_sample(s3: dict, s3_server: str, packed: Path, latency_proxy,  # type: ignore[no-untyped-def]
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A fifth of responses reset part-way (mostly mid-body, where a retry asks for the
    rest) and 20% of GETs answered 503 SlowDown: every sample exactly once, nothing given up,
    and the throttling shows in stats(). (An epoch is a few dozen requests: at 10% of them,
    one in ~50 runs saw no reset at all. A dataset's reads get their full 10 attempts here,
    as they do outside the tests: at 5, one request in ~100 of this storm failed 5 times.)"""
    monkeypatch.setattr(shardkit.storage.retry, "OUTAGE_RETRIES", 10)
    fs, root = fsspec.core.url_to_fs(s3["url"] + "/ds", **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(s3_server, latency_ms=5, seed=3)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    ds = StreamingDataset(s3["url"] + "/ds", storage_options=opts, shuffle=True, block=4)
    control.set("reset_prob", 0.2)
    control.set("reset_max_bytes", 2_000)
    control.storm(600, 0.2)  # for the whole epoch
    got = keys(ds, workers=2)
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    stats = control.stats()
    assert stats["throttled"] > 0 and stats["resets"] > 0
    assert ds.stats()["throttled"] > 0


@pytest.mark.parametrize("store", ["s3", "s3 client", "gcs"])
def test_a_shard_replaced_under_its_name_is_caught_at_its_first_read(store: str, request: pytest.FixtureRequest,
                                                                     photos: Path) -> None:
    """The index pins each shard's version (S3's ETag, GCS's generation): a shard replaced
    since is named at its first read (S3: the GET is If-Match, on plain HTTP or, where the
    options set TLS up, through s3fs's client; GCS: checked on open) and handled by on_error;
    `shardkit index --versions` records the new versions."""
    client = store == "s3 client"
    store = store.split()[0]
    remote = request.getfixturevalue(store)
    url, opts = remote["url"] + "/ds", remote["storage_options"]
    if client:
        opts = {**opts, "client_kwargs": {**opts["client_kwargs"], "verify": False}}  # (plain HTTP: no TLS to verify)
        assert not shardkit.storage.s3_http.usable(opts)
    if store == "s3":  # a proxy that botocore would go through: so does every read
        proxy = {"config_kwargs": {"proxies": {"http": "http://127.0.0.1:9"}}}
        assert shardkit.storage.s3_http.usable(opts) != client and not shardkit.storage.s3_http.usable(
            {**opts, **proxy})
    idx = shardkit.pack(str(photos), url, max_count=10, workers=1, progress=False, storage_options=opts)
    kind = "etag" if store == "s3" else "generation"
    assert all(s.version is not None and list(s.version) == [kind] for s in idx.shards)
    assert index.load(url, opts).shards == idx.shards
    fs, root = fsspec.core.url_to_fs(url, **opts)
    name = idx.shards[1].name
    data = bytearray(fs.cat_file(f"{root}/{name}"))
    data[-1030] ^= 1  # a byte of the last image: the same size and layout, other bytes
    fs.pipe(f"{root}/{name}", bytes(data))
    with pytest.raises(CorruptShardError, match=rf"{remote['url']}/ds/{name}: changed since its index was made"):
        keys(StreamingDataset(url, storage_options=opts))
    replaced = {m.split(".")[0] for m in tarfile.open(fileobj=io.BytesIO(bytes(data))).getnames()}
    skipping = StreamingDataset(url, storage_options=opts, on_error="skip", shuffle=True)
    got = keys(skipping)
    assert len(got) == 30 and not replaced & set(got) and len(replaced) == 10
    assert skipping.stats()["skipped"] == 10
    endpoint = {"s3": ["-o", f'client_kwargs={{"endpoint_url": "{s3_endpoint(opts)}"}}', "-o", "key=testing",
                       "-o", "secret=testing"],
                "gcs": ["-o", f"endpoint_url={opts.get('endpoint_url')}", "-o", "token=anon"]}[store]
    with pytest.raises(SystemExit) as done:
        main(["index", "--versions", url, *endpoint])
    assert done.value.code == 0
    assert sorted(keys(StreamingDataset(url, storage_options=opts))) == sorted(set(got) | replaced)


def s3_endpoint(opts: dict) -> str:
    return str((opts.get("client_kwargs") or {}).get("endpoint_url"))
