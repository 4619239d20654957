"""The latency proxy (latency_proxy.py beside this module: delay, latency tail, per-connection
bandwidth cap, RST, stall and throttling faults in front of any server): its start-up, one
for the tests' `latency_proxy` fixture and the benchmarks, and its control port's client."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Callable, NoReturn
from urllib.parse import urlsplit, urlunsplit

from .process import Server, raise_failed

SCRIPT = Path(__file__).resolve().parent / "latency_proxy.py"
PROXY_OPTIONS = (
    "conn_mbps",
    "tail_prob",
    "tail_ms",
    "reset_prob",
    "reset_max_bytes",
    "stall_prob",
    "throttle_prob",
    "throttle_status",
    "seed",
)


class ProxyControl:
    """Talks to a running latency proxy's control port (one line per connection)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def send(self, line: str) -> str:
        """One command line; its answer line (ValueError on an error or no answer)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s, s.makefile("rb") as f:
            s.sendall(line.encode() + b"\n")
            answer = f.readline().decode().strip()
        if answer.startswith("error") or not answer:
            raise ValueError(f"latency proxy: {line!r} -> {answer!r}")
        return answer

    def set(self, name: str, value: float) -> None:
        """name: latency_ms, conn_mbps, tail_prob, tail_ms, reset_prob, reset_max_bytes, stall_prob, throttle_prob
        or throttle_status."""
        self.send(f"set {name} {value}")

    def storm(self, seconds: float, prob: float) -> None:
        """Throttle (503 or 429, as throttle_status says) `prob` of the GETs for `seconds`."""
        self.send(f"storm {seconds} {prob}")

    def reset_all(self) -> None:
        """Send an RST to every live client connection."""
        self.send("reset_all")

    def stats(self) -> dict:
        """Counters (connections, active, resets, stalls, throttled, requests, responses, tailed, bytes, bytes_up)
        and current settings."""
        return json.loads(self.send("stats"))


def start_proxy(
    upstream_url: str,
    log: Path,
    latency_ms: float = 0,
    on_failure: Callable[[str], NoReturn] = raise_failed,
    **opts: float,
) -> tuple[Server, str, ProxyControl]:
    """A proxy in front of `upstream_url` (http://HOST:PORT[/...]) with `opts` (PROXY_OPTIONS):
    (its process, the same URL through it, its control)."""
    if unknown := set(opts) - set(PROXY_OPTIONS):
        raise TypeError(f"unknown proxy options {sorted(unknown)}; known: {PROXY_OPTIONS}")
    u = urlsplit(upstream_url)
    cmd = [sys.executable, str(SCRIPT), "--upstream", f"{u.hostname}:{u.port}", "--latency-ms", str(latency_ms)]
    for k, v in opts.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    server = Server("latency_proxy", cmd, log, read_stdout=True, on_failure=on_failure)
    port, cport = server.wait_line()
    return server, urlunsplit(u._replace(netloc=f"127.0.0.1:{port}")), ProxyControl(int(cport))
