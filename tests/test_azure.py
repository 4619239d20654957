"""Azure Blob Storage and ADLS Gen2 against Azurite: every scheme adlfs serves, the ETag
pinned at pack time and checked on every read, throttling (503 ServerBusy, 429) seen by the
read-ahead and retried as on S3 with the client's own retries off, and credentials kept out
of every message. (The contract suite, the replaced-shard test and the pack lock's tests run
over Azure beside S3 and GCS too.)"""

from __future__ import annotations

import io
import os
import re
import tarfile
from pathlib import Path

import fsspec
import pytest
from torch.utils.data import DataLoader

import shardkit
from shardkit import StreamingDataset, index
from shardkit.errors import AccessDeniedError, CorruptShardError, ShardkitError, redact
from shardkit.storage.stores import store_for

from servers.azurite import ACCOUNT, connection_string

pytest.importorskip("adlfs", reason="adlfs is not installed (pip install '.[azure]'): the Azure tests are skipped")


def keys(ds: StreamingDataset, workers: int = 0) -> list[str]:
    return [s["__key__"] for s in DataLoader(ds, batch_size=None, num_workers=workers)]


def test_pack_and_read_back_under_each_scheme(azure: dict, packed: Path) -> None:
    """`shardkit pack` into az://, read back as abfs:// and abfss:// (adlfs serves all three,
    and ADLS Gen2's CONTAINER@ACCOUNT.dfs.core.windows.net form), every sample once under
    DataLoader workers, each shard pinned by its ETag."""
    url, opts = azure["url"] + "/ds", azure["storage_options"]
    idx = shardkit.pack(
        str(packed.parent / "photos"), url, max_count=30, workers=1, progress=False, storage_options=opts
    )
    assert all(list(s.version or {}) == ["etag"] for s in idx.shards) and len(idx.shards) == 4
    assert index.load(url, opts).shards == idx.shards and shardkit.verify(url, opts) == []
    container = azure["url"].removeprefix("az://")
    for other in (
        f"abfs://{container}/",
        f"abfss://{container}/",
        f"abfss://{container}@{ACCOUNT}.dfs.core.windows.net/",
    ):  # ADLS Gen2's form
        ds = StreamingDataset(url.replace(f"az://{container}/", other), storage_options=opts, shuffle=True)
        got = keys(ds, workers=2)
        assert sorted(got) == [f"{i:06d}" for i in range(120)], other
    assert ds.stats()["store"] == "azure (adlfs)"


def test_a_shard_overwritten_with_another_shards_bytes_is_named_at_its_first_read(azure: dict, photos: Path) -> None:
    """Issue 41: Azure read a replaced shard silently (an epoch of 90 samples, 30 of them
    another shard's a second time). Now every ranged read is If-Match the ETag of the index:
    the first read of the replaced shard fails naming it, and on_error="skip" leaves it out."""
    url, opts = azure["url"] + "/ds", azure["storage_options"]
    idx = shardkit.pack(str(photos), url, max_count=10, workers=1, progress=False, storage_options=opts)
    fs, root = fsspec.core.url_to_fs(url, **opts)
    first, replaced = idx.shards[0].name, idx.shards[1].name
    data, gone = fs.cat_file(f"{root}/{first}"), members(fs.cat_file(f"{root}/{replaced}"))
    fs.pipe(f"{root}/{replaced}", data)
    with pytest.raises(CorruptShardError, match=rf"^{url}/{replaced}: changed since its index was made"):
        keys(StreamingDataset(url, storage_options=opts))
    skipping = StreamingDataset(url, storage_options=opts, on_error="skip", shuffle=True)
    got = keys(skipping, workers=2)  # its 10 samples skipped, and 10 of the others repeated in their place
    assert len(got) == 30 and set(got) == {f"{i:06d}" for i in range(30)} - gone and len(gone) == 10
    assert skipping.stats()["skipped"] == 10


def members(shard: bytes) -> set[str]:
    return {m.split(".")[0] for m in tarfile.open(fileobj=io.BytesIO(shard)).getnames()}


@pytest.mark.parametrize("status", [503, 429])
def test_throttling_is_retried_and_slows_the_read_ahead(
    status: int, azure: dict, azure_server: str, packed: Path, latency_proxy, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """503 (Azure's ServerBusy) and 429, from a proxy in front of Azurite on a fifth of the
    GETs and HEADs of a whole epoch (the proxy's bodies are S3's and GCS's: the client goes by
    the status): every sample exactly once, and the throttling counted in stats(), where the
    read-ahead's AIMD sees it (the SDK's own retries would hide it)."""
    monkeypatch.setattr(shardkit.storage.patience, "OUTAGE_RETRIES", 10)
    url, opts = azure["url"] + "/ds", azure["storage_options"]
    fs, root = fsspec.core.url_to_fs(url, **opts)
    fs.put(str(packed), root, recursive=True)
    proxied, control = latency_proxy(azure_server, latency_ms=2, throttle_status=status, seed=5)
    ds = StreamingDataset(url, storage_options={"connection_string": connection_string(proxied)}, shuffle=True, block=4)
    control.storm(600, 0.2)
    got = keys(ds, workers=2)
    assert sorted(got) == sorted(set(got)) and len(got) == 120
    assert control.stats()["throttled"] > 0 and ds.stats()["throttled"] > 0


def test_a_store_that_keeps_throttling_fails_after_our_attempts_only(
    azure: dict, azure_server: str, latency_proxy
) -> None:  # type: ignore[no-untyped-def]
    """Every request throttled: a read fails after shardkit's 5 attempts, one request each
    (azure-storage-blob would make 4 of each, 15 s and more apart), naming the URL."""
    url = azure["url"] + "/x"
    fsspec.filesystem("az", **azure["storage_options"]).pipe(url, b"data")
    proxied, control = latency_proxy(azure_server, throttle_prob=1)
    with pytest.raises(ShardkitError, match=rf"^{url}: AzureRequestError: 503 .*\(gave up after 5 attempts\)$"):
        shardkit.storage.read_bytes(url, {"connection_string": connection_string(proxied)})
    assert control.stats()["throttled"] == 5


FAKE_KEY = "c2hhcmRraXQtZmFrZS1hY2NvdW50LWtleS1kby1ub3Qtc2hvdw=="  # base64, as account keys are
FAKE_SIG = "shardkitFakeSignatureDoNotShow"


@pytest.mark.parametrize("how", ["account key", "sas", "environment"])
def test_refused_credentials_name_the_url_and_never_the_secret(
    how: str, azure: dict, azure_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key or SAS that Azure refuses (403): AccessDeniedError naming the URL, at once, with
    neither the secret nor the connection string in the message or any error it came from."""
    url = azure["url"] + "/ds"
    endpoint = f"{azure_server}/{ACCOUNT}"
    sas = f"BlobEndpoint={endpoint};SharedAccessSignature=sv=2023-11-03&ss=b&srt=co&sp=rl&sig={FAKE_SIG}"
    with_key = connection_string(azure_server, FAKE_KEY)
    secret = FAKE_SIG if how == "sas" else FAKE_KEY
    opts: dict = {"connection_string": sas if how == "sas" else with_key}
    if how == "environment":
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", with_key)
        opts = {}
    with pytest.raises(AccessDeniedError, match=rf"^{url}/index.json: 403 \w+: ") as refused:
        StreamingDataset(url, storage_options=opts)
    chain, e = [], refused.value
    while e is not None:
        chain.append(f"{e} {e.args}")
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    assert len(chain) > 1 and not [text for text in chain if secret in text or "AccountKey=" in text]
    assert secret not in redact(f"a client quoting {secret} alone")  # every message of the process


def test_a_conditional_write_into_a_missing_container_fails_naming_it(azure: dict) -> None:
    """The pack lock's create (Put Blob If-None-Match *) answered 404 ContainerNotFound: an
    error naming the URL, not a refusal that would read as another pack holding the lock.
    (test_hostile runs the lock's other conditional writes on Azure.)"""
    url = re.sub(r"shardkit-\d+", "no-such-container", azure["url"]) + "/ds/.shardkit-lock"
    with pytest.raises(ShardkitError, match=rf"^{url}: 404 ContainerNotFound: The specified container does not"):
        store_for(url, azure["storage_options"]).put_if_absent(url, b"x")


def test_a_blob_read_in_order_is_pinned_to_its_first_etag(azure: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """storage.open_read (an LMDB's data.mdb, an offsets file, verify's sha256): ranged
    downloads in order, an empty blob read as no bytes, a missing one failing as it is
    opened, and a blob replaced between two downloads failing, named, not mixing versions."""
    from shardkit.storage.stores.azure import InOrder

    monkeypatch.setattr(InOrder, "BLOCK", 64 << 10)
    url, opts = azure["url"], azure["storage_options"]
    fs = fsspec.filesystem("az", **opts)
    some = bytes(range(256)) * 800  # 200 KiB: 4 downloads
    fs.pipe({f"{url}/empty": b"", f"{url}/some": some})
    for name, data in (("empty", b""), ("some", some)):
        with shardkit.storage.open_read(f"{url}/{name}", opts) as f:
            assert b"".join(iter(lambda: f.read(10_000), b"")) == data
    with pytest.raises(FileNotFoundError, match=rf"^{url}/missing: 404 BlobNotFound"):
        shardkit.storage.open_read(f"{url}/missing", opts)
    with shardkit.storage.open_read(f"{url}/some", opts) as f:
        assert f.read(1000) == some[:1000]
        fs.pipe(f"{url}/some", some[::-1])
        with pytest.raises(ShardkitError, match=rf"^{url}/some: 412 ConditionNotMet: replaced while it was read"):
            f.read()


@pytest.mark.parametrize("option", ["read_timeout", "timeout"])
def test_a_silent_store_fails_by_the_read_timeout_of_the_options(
    option: str, azure: dict, azure_server: str, latency_proxy
) -> None:  # type: ignore[no-untyped-def]
    """adlfs's `read_timeout`, or shardkit's own `timeout`, holds for shardkit's requests: a
    store that takes the request and then says nothing fails each attempt by it, and after 3
    silent ones the read, named, instead of the SDK's 60 s a try."""
    url = azure["url"] + "/x"
    fsspec.filesystem("az", **azure["storage_options"]).pipe(url, b"data")
    proxied, control = latency_proxy(azure_server, stall_prob=1)
    opts = {"connection_string": connection_string(proxied), option: 1}
    said = (
        r"ServiceResponseTimeoutError: Timeout on reading data from socket \(gave up after 3 attempts; the "
        r"storage options timeout= and attempts= set how long to wait\)"
    )
    with pytest.raises(ShardkitError, match=rf"^{url}: {said}$"):
        shardkit.storage.read_range(url, 0, 4, opts)
    assert control.stats()["stalls"] == 3


def test_no_credentials_at_all_fail_at_once_saying_so(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """An account name alone: adlfs asks azure-identity's DefaultAzureCredential, which finds
    nothing here (no AZURE_* variables; the sign-in tools it would also ask are excluded by
    its own options, so a developer's `az login` does not change the outcome). One line naming
    the URL, at once (no retries: none can find a credential), and none of azure-identity's
    dozen lines of warnings on stderr."""
    for name in [k for k in os.environ if k.startswith("AZURE_")]:
        monkeypatch.delenv(name)
    excluded = {
        f"exclude_{c}_credential": True
        for c in ("cli", "powershell", "developer_cli", "visual_studio_code", "shared_token_cache", "managed_identity")
    }
    opts = {"account_name": ACCOUNT, "account_host": "127.0.0.1:9", **excluded}
    with pytest.raises(
        AccessDeniedError,
        match=r"^az://data/ds/index.json: no credentials: DefaultAzureCredential "
        r"failed to retrieve a token .*\(give storage_options a connection",
    ):
        StreamingDataset("az://data/ds", storage_options=opts)
    assert capfd.readouterr().err == ""
