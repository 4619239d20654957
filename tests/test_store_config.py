"""What shardkit decided for a store (the client, and for S3 the endpoint, addressing style,
region and checksums, and why) is what `shardkit info -v` prints and `stats()["store_config"]`
holds, and each decision is one the store then reads with: on moto and SeaweedFS."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import shardkit
from shardkit import StreamingDataset
from shardkit.cli import main
from shardkit.storage.clients import s3_compatible
from shardkit.storage.s3_config import decisions

from readers import WARNINGS

pytestmark = WARNINGS


def _info(url: str, opts: dict) -> str:
    args = ["info", "-v", url, *(f"-o{k}={json.dumps(v)}" for k, v in opts.items())]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _keys(url: str, opts: dict) -> tuple[list[str], dict]:
    ds = StreamingDataset(url, storage_options=opts)
    return [s["__key__"] for s in ds], ds.stats()


@pytest.fixture
def packed_s3(s3_any: dict, photos: Path) -> tuple[str, dict]:
    url, opts = s3_any["url"] + "/ds", s3_any["storage_options"]
    shardkit.pack(str(photos), url, max_count=10, workers=1, progress=False, storage_options=opts)
    return url, opts


def test_an_endpoint_of_its_own_reads_path_style_through_presigned_gets(packed_s3: tuple[str, dict]) -> None:
    url, opts = packed_s3
    endpoint = opts["client_kwargs"]["endpoint_url"]
    keys, stats = _keys(url, opts)
    assert len(set(keys)) == 30 and stats["store"] == "s3 (presigned)"
    [config] = stats["store_config"]
    assert config["store"] == "s3 (presigned)" and config["endpoint"] == endpoint
    assert config["addressing"].startswith("path (an endpoint not AWS's")
    assert config["checksums"].startswith("only where S3's API requires them")
    assert config["region"].startswith("us-east-1 (none given")
    assert config["client"].startswith("presigned GETs")
    out = _info(url, opts)
    assert "store:    s3 (presigned)\n" in out and f"  endpoint:   {endpoint}\n" in out
    assert all(f"  {name + ':':<12}{value}\n" in out for name, value in config.items() if name != "store"), out


def test_options_botocore_must_apply_read_through_s3fs_and_say_why(packed_s3: tuple[str, dict]) -> None:
    url, opts = packed_s3
    opts = {**opts, "client_kwargs": {**opts["client_kwargs"], "verify": False}}  # (plain HTTP: nothing to verify)
    keys, stats = _keys(url, opts)
    assert len(set(keys)) == 30 and stats["store"] == "s3fs"
    [config] = stats["store_config"]
    assert config["client"] == "s3fs (the options set client_kwargs.verify, which botocore's client applies)"
    assert config["addressing"].startswith("path (") and config["checksums"].startswith("only where")
    assert "store:    s3fs\n" in _info(url, opts)


def test_a_region_and_an_addressing_style_given_are_the_ones_used(packed_s3: tuple[str, dict]) -> None:
    """R2 wants the region 'auto'; a store may want another name: signed for it, read, and shown."""
    url, opts = packed_s3
    opts = {
        **opts,
        "client_kwargs": {**opts["client_kwargs"], "region_name": "auto"},
        "config_kwargs": {"s3": {"addressing_style": "path"}, "request_checksum_calculation": "when_required"},
    }
    keys, stats = _keys(url, opts)
    assert len(set(keys)) == 30 and stats["store"] == "s3 (presigned)"  # (the checksum setting concerns no GET)
    [config] = stats["store_config"]
    assert config["region"] == "auto (the options')" and config["addressing"] == "path (the options')"
    assert config["checksums"] == "when_required (the options')"


def test_an_endpoint_named_by_aws_variables_is_one_of_its_own(
    s3_any: dict, photos: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS_ENDPOINT_URL alone, as botocore reads it: path-style and the checksum setting too."""
    opts = {k: v for k, v in s3_any["storage_options"].items() if k != "client_kwargs"}
    endpoint = s3_any["storage_options"]["client_kwargs"]["endpoint_url"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    url = s3_any["url"] + "/env"
    shardkit.pack(str(photos), url, max_count=10, workers=1, progress=False, storage_options=opts)
    keys, stats = _keys(url, opts)
    assert len(set(keys)) == 30
    [config] = stats["store_config"]
    assert config["endpoint"] == f"{endpoint} (AWS_ENDPOINT_URL)" and config["addressing"].startswith("path (")
    assert s3_compatible(opts)["s3"] == {"addressing_style": "path"}
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")
    assert s3_compatible(opts) == {}


def test_aws_itself_is_left_to_botocore_s_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    config = decisions("s3://bucket/ds/shard-000000.tar", {"anon": True})
    assert config["endpoint"] == "AWS's (s3.us-east-1.amazonaws.com)"
    assert config["addressing"] == "virtual-hosted where the bucket's name allows, else path (botocore's auto)"
    assert config["checksums"].startswith("botocore's default") and config["client"].startswith("presigned")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    assert decisions("s3://bucket/k", {"anon": True})["endpoint"] == "AWS's (s3.eu-west-3.amazonaws.com)"
    assert decisions("s3://bucket", {"anon": True})["client"] == "s3fs (the URL names a bucket alone)"
    assert decisions("s3://b--usw2-az1--x-s3/k", {"anon": True})["client"].startswith("s3fs (a directory bucket")


def test_a_local_dataset_and_a_mix_say_what_reads_them(packed: Path, packed_s3: tuple[str, dict]) -> None:
    local = StreamingDataset(str(packed))
    assert local.stats()["store_config"] == [{"store": "local"}]
    assert _info(str(packed), {}).endswith("store:    local\n")
    url, opts = packed_s3
    mixed = StreamingDataset.mix([(local, 0.5), (StreamingDataset(url, storage_options=opts), 0.5)])
    assert [c["store"] for c in mixed.stats()["store_config"]] == ["local", "s3 (presigned)"]
