"""pytest plugin: Azurite, Microsoft's Azure Storage emulator (its Blob service), on loopback.

One `azurite-blob` process per session on a free 127.0.0.1 port, over a session folder,
stopped at the end; `azure` hands each test an empty container of its own and the storage
options that reach it: Azurite's well-known development account, in a connection string.

Azurite is an npm package: scripts/_setup.sh installs it into `.azurite/` (gitignored);
AZURITE_BLOB=PATH names another `azurite-blob`. Without it (or without node) the tests that
use these fixtures are skipped, saying why; no other test is.
"""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from .fixtures import fail_test
from .process import Server, free_port

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "devstoreaccount1"
# Azurite's development account key: public, the same in every Azurite (its documentation's)
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_CONTAINERS = itertools.count()


def connection_string(endpoint: str, key: str = ACCOUNT_KEY) -> str:
    """A connection string for the development account at `endpoint` (http://HOST:PORT)."""
    return f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};BlobEndpoint={endpoint}/{ACCOUNT};"


def azurite_blob() -> str | None:
    """The `azurite-blob` to run: AZURITE_BLOB, the project's own (.azurite/), else on PATH."""
    named = os.environ.get("AZURITE_BLOB")
    if named:
        return named
    local = ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"
    return str(local) if local.exists() else shutil.which("azurite-blob")


@pytest.fixture(scope="session")
def azure_server(_server_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint (http://127.0.0.1:PORT) of an Azurite Blob service, one per session."""
    exe = azurite_blob()
    if exe is None:
        why = "Azurite is not installed (scripts/_setup.sh installs it with npm into .azurite/; it needs node and npm)"
    elif not Path(exe).exists():
        why = f"AZURITE_BLOB={exe} is not there"
    elif shutil.which("node") is None:
        why = "node, which Azurite runs on, is not on PATH"
    else:
        why = ""
    if why:
        pytest.skip(f"{why}: the Azure tests are skipped")
    pytest.importorskip("adlfs", reason="adlfs is not installed (pip install 'shardkit[azure]')")
    port = free_port()
    where = tmp_path_factory.mktemp("azurite")
    cmd = [
        exe,
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(port),
        "--location",
        str(where),
        "--skipApiVersionCheck",
        "--silent",
    ]
    server = Server("azurite-blob", cmd, _server_logs / "azurite.log", on_failure=fail_test)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        server.wait_http(f"{endpoint}/{ACCOUNT}?comp=list")  # 403 (unsigned) once it listens
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def azure(azure_server: str) -> dict:
    """An empty container of this test's own: {"url": "az://shardkit-N", "storage_options": {...}}."""
    from azure.storage.blob import BlobServiceClient

    name = f"shardkit-{next(_CONTAINERS)}"
    options = {"connection_string": connection_string(azure_server)}
    with BlobServiceClient.from_connection_string(options["connection_string"]) as client:
        client.create_container(name)
    return {"url": f"az://{name}", "storage_options": {**options, "skip_instance_cache": True}}
