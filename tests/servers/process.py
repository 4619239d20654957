"""Server processes for the tests and the benchmarks (bench/): one subprocess with its log,
waited for until it answers, stopped with terminate, 5 s, kill. No pytest here: a failure
calls the `on_failure` it was given (the test plugin's fails the test; the default raises
ServerFailed, which a benchmark lets end it)."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Callable, Iterator, NoReturn

BIN = Path(sys.executable).parent
BUCKET = "shardkit-test"
READY_S = 30.0


class ServerFailed(RuntimeError):
    """A server did not start, or is gone; the message ends with its log's tail."""


def raise_failed(message: str) -> NoReturn:
    raise ServerFailed(message)


# Run a command so that the kernel SIGTERMs it when the test process dies (Linux): even a pytest
# killed with SIGKILL leaves no server behind.
_DIE_WITH_PARENT = """import ctypes, os, signal, sys
try:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit("parent already gone")
os.execv(sys.argv[2], sys.argv[2:])
"""


class Server:
    """One server subprocess; stderr (and stdout, unless read for a ready line) go to a log file."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        log: Path,
        read_stdout: bool = False,
        on_failure: Callable[[str], NoReturn] = raise_failed,
    ) -> None:
        self.on_failure = on_failure
        if not Path(cmd[0]).exists():
            hint = "pip install s3fs 'moto[server]' gcsfs gcp-storage-emulator"
            on_failure(f"{name}: {cmd[0]} not found; install the test servers: {hint}")
        self.name, self.log_path = name, log
        self.log: IO[bytes] = open(log, "wb")
        if sys.platform.startswith("linux"):
            cmd = [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if read_stdout else self.log, stderr=self.log
        )
        self.deadline = time.monotonic() + READY_S

    def check(self) -> None:
        """Fail the test, with the server's log, if the server is gone."""
        if self.proc.poll() is not None:
            self.fail(f"exited early with code {self.proc.returncode}")

    def fail(self, why: str) -> NoReturn:
        self.log.flush()
        tail = self.log_path.read_bytes()[-3000:].decode("utf-8", "replace")
        self.on_failure(f"{self.name} {why}; its log {self.log_path} ends with:\n{tail}")

    def wait_http(self, url: str) -> None:
        """Poll url until any HTTP answer (an error status counts) comes back."""
        while True:
            self.check()
            try:
                urllib.request.urlopen(url, timeout=1).close()
                return
            except urllib.error.HTTPError as e:
                e.close()
                return
            except OSError:
                pass
            if time.monotonic() > self.deadline:
                self.fail(f"did not answer {url} within {READY_S:.0f} s")
            time.sleep(0.05)

    def wait_line(self) -> list[str]:
        """Wait for the 'ready ...' line on stdout; return its words after 'ready'."""
        assert self.proc.stdout is not None
        while not select.select([self.proc.stdout], [], [], 0.1)[0]:
            self.check()
            if time.monotonic() > self.deadline:
                self.fail(f"printed no ready line within {READY_S:.0f} s")
        words = self.proc.stdout.readline().decode().split()
        if not words:  # EOF: it is exiting
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            self.check()
        if not words or words[0] != "ready":
            self.fail(f"printed {' '.join(words)!r} instead of a ready line")
        return words[1:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> bytes:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


def holds_port(pid: int, port: int) -> bool:
    """Whether process `pid` holds the socket listening on 127.0.0.1:`port` (True where /proc
    cannot tell: not Linux)."""
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return True
    wanted = {f"socket:[{f[9]}]" for f in map(str.split, lines) if f[1] == f"0100007F:{port:04X}" and f[3] == "0A"}
    held = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            held.add(os.readlink(fd))
    return bool(wanted & held)


@contextlib.contextmanager
def serve_http(
    name: str,
    cmd: Callable[[int], list[str]],
    probe: str,
    logs: Path,
    on_failure: Callable[[str], NoReturn] = raise_failed,
) -> Iterator[tuple[Server, str]]:
    """A server on a free port that answers `probe`. free_port() closes its socket before the
    server binds: another process (another pytest-xdist worker's server) may take the port in
    between, and answer the probe in its stead, so the port must be the server's own."""
    for _ in range(3):
        port = free_port()
        server = Server(name, cmd(port), logs / f"{name}.log", on_failure=on_failure)
        try:
            url = f"http://127.0.0.1:{port}"
            server.wait_http(url + probe)
            if holds_port(server.proc.pid, port):
                yield server, url
                return
        finally:
            server.stop()
    on_failure(f"{name}: its free port was taken by another process, 3 times")
