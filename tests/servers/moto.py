"""moto in server mode (S3): its start-up, one for the tests' `s3` fixtures and the benchmarks."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, NoReturn

from .process import BIN, Server, raise_failed, serve_http


def serve_moto(
    logs: Path, on_failure: Callable[[str], NoReturn] = raise_failed
) -> AbstractContextManager[tuple[Server, str]]:
    """(its process, its endpoint URL) of a moto_server on a free loopback port, its log in
    `logs`, stopped on exit."""
    cmd = lambda port: [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]  # noqa: E731
    return serve_http("moto_server", cmd, "/moto-api/", logs, on_failure)
