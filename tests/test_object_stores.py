"""Object stores as they are, against moto's S3 server, the GCS emulator and the fault proxy:
throttling (503 SlowDown) and resets that must cost no sample, and shards replaced under
their names, which the index's versions catch at their first read."""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, unquote, urlsplit

import fsspec
import pytest
from torch.utils.data import DataLoader

import shardkit
import shardkit.storage.s3_http
from shardkit import StreamingDataset, index
from shardkit.cli import main
from shardkit.errors import CorruptShardError

from servers import serving


def keys(ds: StreamingDataset, workers: int = 0) -> list[str]:
    return [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=workers)]


def test_throttling_and_resets_cost_no_sample(
    s3: dict,
    s3_server: str,
    packed: Path,
    latency_proxy,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fifth of responses reset part-way (mostly mid-body, where a retry asks for the
    rest) and 20% of GETs answered 503 SlowDown: every sample exactly once, nothing given up,
    and the throttling shows in stats(). (An epoch is a few dozen requests: at 10% of them,
    one in ~50 runs saw no reset at all. A dataset's reads get their full 10 attempts here,
    as they do outside the tests: at 5, one request in ~100 of this storm failed 5 times.)"""
    monkeypatch.setattr(shardkit.storage.patience, "OUTAGE_RETRIES", 10)
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


def test_throttled_opening_reads_count_in_stats(
    s3: dict,
    s3_server: str,
    packed: Path,
    latency_proxy,  # type: ignore[no-untyped-def]
) -> None:
    """A store that throttles the reads that open a dataset (its index, its offsets file):
    opened all the same, and those answers counted in stats() before any sample is read
    (only the ranged reads' throttling used to be)."""
    fs, root = fsspec.core.url_to_fs(s3["url"] + "/ds", **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(s3_server, seed=4)
    opts = {**s3["storage_options"], "client_kwargs": {"endpoint_url": proxied}}
    control.storm(2, 1.0)  # every request for 2 s: the first opening read at least
    ds = StreamingDataset(s3["url"] + "/ds", storage_options=opts)
    assert control.stats()["throttled"] > 0 and ds.stats()["throttled"] > 0
    assert len(keys(ds)) == 120


@pytest.mark.parametrize("store", ["s3", "s3 client", "seaweedfs", "gcs", "fakegcs", "azure"])
def test_a_shard_replaced_under_its_name_is_caught_at_its_first_read(
    store: str, request: pytest.FixtureRequest, photos: Path
) -> None:
    """The index pins each shard's version (S3's and Azure's ETag, GCS's generation): a shard
    replaced since is named at its first read (S3: the GET is If-Match, on plain HTTP or, where
    the options set TLS up, through s3fs's client; Azure: If-Match too; GCS: checked on open)
    and handled by on_error;
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
            {**opts, **proxy}
        )
    idx = shardkit.pack(str(photos), url, max_count=10, workers=1, progress=False, storage_options=opts)
    api = {"seaweedfs": "s3", "fakegcs": "gcs"}.get(store, store)
    kind = "generation" if api == "gcs" else "etag"
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
    endpoint = {
        "s3": [
            "-o",
            f'client_kwargs={{"endpoint_url": "{s3_endpoint(opts)}"}}',
            "-o",
            f"key={opts.get('key')}",
            "-o",
            f"secret={opts.get('secret')}",
        ],
        "gcs": ["-o", f"endpoint_url={opts.get('endpoint_url')}", "-o", "token=anon"],
        "azure": ["-o", f"connection_string={opts.get('connection_string')}"],
    }[api]
    with pytest.raises(SystemExit) as done:
        main(["index", "--versions", url, *endpoint])
    assert done.value.code == 0
    assert sorted(keys(StreamingDataset(url, storage_options=opts))) == sorted(set(got) | replaced)


def s3_endpoint(opts: dict) -> str:
    return str((opts.get("client_kwargs") or {}).get("endpoint_url"))


@pytest.mark.parametrize("credentials", ["options", "environment", "profile"])
def test_s3_reads_are_presigned_without_s3fs(credentials: str, s3: dict, packed: Path, tmp_path: Path) -> None:
    """Reading a dataset from S3 (its index and its shards) signs each GET with botocore's
    signer alone: s3fs, aiobotocore and aiohttp stay unimported (~0.3 s of a process's start),
    whichever way the credentials come: the options, AWS_* variables, or a profile."""
    fs, root = fsspec.core.url_to_fs(s3["url"] + "/ds", **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    opts = {k: v for k, v in s3["storage_options"].items() if k not in ("key", "secret")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"),
    )
    if credentials == "options":
        opts.update(key="testing", secret="testing")
    elif credentials == "environment":
        env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    else:
        (tmp_path / "credentials").write_text("[train]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
        opts["profile"] = "train"
    code = (
        "import json, sys, shardkit\n"  # a fresh cache: the index's offsets file is fetched too
        f"ds = shardkit.StreamingDataset({s3['url'] + '/ds'!r}, storage_options=json.loads(sys.argv[1]), "
        f"cache_dir={str(tmp_path / 'cache')!r})\n"
        "keys = [s['__key__'] for s in ds]\n"
        "print(len(keys), len(set(keys)), [m for m in ('s3fs', 'aiobotocore', 'aiohttp') if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(opts)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(maxsplit=2) == ["120", "120", "[]\n"]


class _OtherRegion(http.server.SimpleHTTPRequestHandler):
    """S3's answer to a GET signed for a region other than its bucket's: 400, naming the
    bucket's region (x-amz-bucket-region). Signed for eu-north-1, the bytes asked for."""

    regions: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        credential = parse_qs(urlsplit(self.path).query).get("X-Amz-Credential", ["////"])[0]
        self.regions.append(credential.split("/")[2])
        if self.regions[-1] == "eu-north-1":
            spec = self.headers.get("Range", "bytes=0-").removeprefix("bytes=")
            data = Path(self.translate_path(self.path)).read_bytes()
            first, _, last = spec.partition("-")
            body = data[int(first) : int(last) + 1 if last else None]
            self.send_response(206 if "Range" in self.headers else 200)
            if "Range" in self.headers:
                self.send_header("Content-Range", f"bytes {first}-{int(first) + len(body) - 1}/{len(data)}")
        else:
            body = (
                b"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region is wrong; expecting "
                b"'eu-north-1'</Message></Error>"
            )
            self.send_response(400)
            self.send_header("x-amz-bucket-region", "eu-north-1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_bucket_in_another_region_is_asked_again_there(
    packed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No region in the options or the environment: a GET goes out signed for us-east-1, and
    the bucket's region that S3's error names is used from then on (one request more)."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    (tmp_path / "bkt").mkdir()
    os.symlink(packed, tmp_path / "bkt" / "ds")
    _OtherRegion.regions.clear()
    with serving(functools.partial(_OtherRegion, directory=str(tmp_path))) as base:
        opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": base}}
        got = {s["__key__"]: s["jpg"] for s in StreamingDataset("s3://bkt/ds", storage_options=opts, shuffle=True)}
    assert got == {s["__key__"]: s["jpg"] for s in StreamingDataset(str(packed))}
    assert _OtherRegion.regions.count("us-east-1") == 1 and len(_OtherRegion.regions) > 2


def test_presigned_urls_address_buckets_as_botocore_does(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Virtual-hosted on AWS where the bucket's name allows, path-style for a name with dots
    and on another endpoint (what S3-compatible stores serve) unless told otherwise; a key
    quoted as botocore quotes it; no signature with anon; the region botocore would take."""
    for name in [k for k in os.environ if k.startswith(("AWS_", "FSSPEC_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("FSSPEC_CONFIG_DIR", str(tmp_path / "fsspec"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_REGION", "ap-south-1")  # botocore reads AWS_DEFAULT_REGION only

    def url(opts: dict, path: str) -> str:
        found = shardkit.storage.s3_http.direct({"key": "k", "secret": "s", **opts})
        assert found is not None
        return found._url(path)[0]

    assert url({}, "bkt/a b/c~d+e=f.tar").startswith("https://bkt.s3.eu-west-3.amazonaws.com/a%20b/c~d%2Be%3Df.tar?X-")
    assert url({}, "my.bkt/x.tar").startswith("https://s3.eu-west-3.amazonaws.com/my.bkt/x.tar?")
    assert url({"config_kwargs": {"s3": {"addressing_style": "path"}}}, "bkt/x").startswith(
        "https://s3.eu-west-3.amazonaws.com/bkt/x?"
    )
    assert url({"endpoint_url": "http://minio:9000"}, "bkt/x").startswith("http://minio:9000/bkt/x?")
    assert url(
        {"endpoint_url": "http://minio:9000", "config_kwargs": {"s3": {"addressing_style": "virtual"}}}, "bkt/x"
    ).startswith("http://bkt.minio:9000/x?")
    assert "/eu-west-3/s3/aws4_request" in unquote(url({}, "bkt/x"))
    assert "/eu-north-1/s3/aws4_request" in unquote(url({"config_kwargs": {"region_name": "eu-north-1"}}, "bkt/x"))
    anon = shardkit.storage.s3_http.direct({"anon": True})
    assert anon is not None and anon._url("bkt/x")[0] == "https://bkt.s3.eu-west-3.amazonaws.com/x"
    for unusual in (
        {"requester_pays": True},
        {"client_kwargs": {"verify": False}},
        {"key": "k"},
        {"config_kwargs": {"s3": {"use_accelerate_endpoint": True}}},
        {"version_aware": True},
        {"config_kwargs": {"use_fips_endpoint": True}},
        {"endpoint_url": "minio:9000"},
        {"client_kwargs": {"region_name": "cn-north-1"}},
    ):
        assert not shardkit.storage.s3_http.usable(unusual), unusual  # read through s3fs's client
    for url_ in ("s3://bkt", "s3://bkt/", "s3://bkt--usw2-az1--x-s3/k", "s3://arn:aws:s3:us-east-1:1:accesspoint/a/k"):
        assert not shardkit.storage.s3_http.presignable(url_), url_
    # what botocore would take from the environment or the AWS config file, s3fs's client applies
    (tmp_path / "config").write_text("[default]\nregion = eu-west-1\n")
    assert "/eu-west-3/" in unquote(url({}, "bkt/x"))  # the variable first, as botocore
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    assert "/eu-west-1/" in unquote(url({}, "bkt/x"))
    (tmp_path / "config").write_text("[default]\nendpoint_url = http://minio:9000\n")
    assert not shardkit.storage.s3_http.usable({})
    (tmp_path / "config").unlink()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    assert url({}, "bkt/x").startswith("http://minio:9000/bkt/x?")
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert url({}, "bkt/x").startswith("https://bkt.s3.us-east-1.amazonaws.com/x?")
    monkeypatch.setenv("FSSPEC_S3_ENDPOINT_URL", "http://minio:9000")
    assert not shardkit.storage.s3_http.usable({})


def test_an_s3_object_read_in_order_empty_or_not(s3: dict) -> None:
    """storage.open_read through presigned GETs: an empty object (S3 answers its range 416)
    reads as no bytes, a missing one fails as it is opened."""
    fs, root = fsspec.core.url_to_fs(s3["url"], **s3["storage_options"])
    fs.pipe({f"{root}/empty": b"", f"{root}/some": b"x" * 70_000})
    assert shardkit.storage.s3_http.usable(s3["storage_options"])
    for name, data in (("empty", b""), ("some", b"x" * 70_000)):
        with shardkit.storage.open_read(f"{s3['url']}/{name}", s3["storage_options"]) as f:
            assert b"".join(iter(lambda: f.read(4096), b"")) == data
    with pytest.raises(FileNotFoundError, match=rf"^{s3['url']}/missing: .*NoSuchKey"):
        shardkit.storage.open_read(f"{s3['url']}/missing", s3["storage_options"])


def test_verify_hashes_s3_shards_through_presigned_gets(s3: dict, packed: Path) -> None:
    """verify=True hashes each S3 shard as a worker first opens it (one GET, no s3fs), and
    names the one whose bytes are not the index's."""
    fs, root = fsspec.core.url_to_fs(s3["url"] + "/ds", **s3["storage_options"])
    fs.put(str(packed), root, recursive=True)
    url, opts = s3["url"] + "/ds", s3["storage_options"]
    assert len({s["__key__"] for s in StreamingDataset(url, storage_options=opts, verify=True)}) == 120
    name = index.load(str(packed)).shards[2].name
    data = bytearray((packed / name).read_bytes())
    data[-1030] ^= 1
    fs.pipe(f"{root}/{name}", bytes(data))
    with pytest.raises(CorruptShardError, match=rf"^{url}/{name}: sha256 mismatch"):
        list(StreamingDataset(url, storage_options=opts, verify=True))
