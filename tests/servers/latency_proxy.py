"""A TCP proxy that delays, caps, resets, stalls or throttles traffic (stdlib only, own process).

    python tests/servers/latency_proxy.py --upstream 127.0.0.1:9000 --latency-ms 50 --conn-mbps 20

Each upstream chunk is released ``latency_ms`` after it arrives: a pipelined delay line (first byte
late, throughput kept; it buffers without bound).  A response starts at the first upstream byte
after the client sent something (HTTP/1.1 alternation, so each request on a keep-alive connection
is one); with ``tail_prob`` its first byte is held ``tail_ms`` instead of ``latency_ms`` (the rest
follows it), with ``reset_prob`` it gets an RST after a uniform 0..N of its bytes (no fault if
shorter), with ``stall_prob`` the connection is black-holed.  ``conn_mbps`` caps each TCP connection,
each direction, with a token bucket of its own (MB = 10**6 bytes; a 64 KiB burst; kept across the
requests of a keep-alive connection, so only idle time refills it): more connections, more
throughput, as on S3 and GCS.  With ``throttle_prob``
a GET or HEAD is not forwarded: the proxy answers it itself, ``throttle_status`` 503 as S3 does
(``SlowDown``, XML) or 429 as GCS does (``rateLimitExceeded``, JSON), and closes the connection.
Prints ``ready PORT CONTROL_PORT``; the control port takes one line per connection: ``set NAME VALUE``
for any setting below (``set latency_ms 100``, ``set conn_mbps 20``, ``set tail_prob 0.05``; live
connections follow at once), ``storm SECONDS PROB`` (throttle_prob PROB for SECONDS, then back),
``reset_all``, ``stats`` (JSON: the settings and counters, ``requests`` begun by clients,
``responses`` begun by the upstream, ``tailed`` of them, ``bytes`` to clients, ``bytes_up`` to the
upstream) or ``trace PATH`` (from now on a JSON line a request to PATH, ``trace off`` stops: its
connection, request line and Range, wall-clock times of the request, its first and last byte to the
client, its bytes, whether it was in the tail; a request's line is written when the next begins on
its connection or the connection ends).  Exits on SIGTERM/SIGINT or when its parent dies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import struct
import time
from collections.abc import Callable
from typing import IO

SETTINGS = {  # name: (type, --help); each is also `set NAME VALUE` on the control port
    "latency_ms": (float, "hold each server->client chunk this many ms (a delay line)"),
    "conn_mbps": (float, "cap each TCP connection, each direction, at this many MB/s (10**6 bytes/s); 0: no cap"),
    "tail_prob": (float, "fraction of responses (seeded draw) whose first byte is held tail_ms, not latency_ms"),
    "tail_ms": (float, "the first-byte delay in ms of a response in the tail"),
    "reset_prob": (float, "fraction of responses cut by an RST after 0..reset_max_bytes bytes"),
    "reset_max_bytes": (int, "most bytes of a response before its RST"),
    "stall_prob": (float, "fraction of responses black-holed (the connection hangs)"),
    "throttle_prob": (float, "fraction of GETs/HEADs answered throttle_status by the proxy itself"),
    "throttle_status": (int, "503 (S3 SlowDown) or 429 (GCS rateLimitExceeded)"),
}
DEFAULTS = {"throttle_status": 503}
BURST = 65536  # bytes a connection's bucket holds: what an idle connection may send at once
RESET = object()  # queue marker: send an RST to the client
EOF = object()  # queue marker: upstream closed


class Bucket:
    """A token bucket of BURST bytes filled at `rate()` bytes/s (0: no cap), kept as the loop time
    its tokens run out; `take(n)` waits until n bytes may pass."""

    def __init__(self, rate: Callable[[], float]) -> None:
        self.rate, self.due = rate, 0.0

    async def take(self, n: int) -> None:
        if (rate := self.rate()) <= 0:
            return
        now = asyncio.get_running_loop().time()
        self.due = max(self.due, now - BURST / rate) + n / rate  # late wake-ups are made up, up to BURST
        if self.due > now:
            await asyncio.sleep(self.due - now)


class Proxy:
    def __init__(self, upstream: tuple[str, int], rng: random.Random, **settings: float) -> None:
        self.upstream, self.rng, self.settings = upstream, rng, settings
        self.live: set[asyncio.StreamWriter] = set()
        self.stats = {
            "connections": 0,
            "resets": 0,
            "stalls": 0,
            "throttled": 0,
            "requests": 0,
            "responses": 0,
            "tailed": 0,
            "bytes": 0,
            "bytes_up": 0,
        }
        self.storm_ends, self.calm = 0.0, 0.0  # loop time the current storm ends, throttle_prob after it
        self.trace: IO[str] | None = None  # `trace PATH`: a JSON line a request

    def traced(self, state: dict, data: bytes | None = None) -> None:
        """With a trace on: write the connection's request that is over, and begin one for `data`
        (a request's first bytes) if given."""
        if self.trace is not None and (done := state.pop("record", None)) is not None:
            self.trace.write(json.dumps(done) + "\n")
            self.trace.flush()
        if self.trace is not None and data is not None:
            head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
            ranged = [line.split(":", 1)[1].strip() for line in head[1:] if line.lower().startswith("range:")]
            state["record"] = {
                "conn": state["conn"],
                "line": head[0][:200],
                "range": ranged[0] if ranged else None,
                "t": time.time(),
                "first": None,
                "last": None,
                "bytes": 0,
                "tailed": False,
            }

    def conn_rate(self) -> float:
        """Bytes/s a connection may move each way; read at each chunk, so `set conn_mbps` applies at once."""
        return self.settings["conn_mbps"] * 1e6

    def rst(self, writer: asyncio.StreamWriter) -> None:
        """Close with SO_LINGER 0, so the kernel sends an RST instead of a FIN."""
        sock = writer.get_extra_info("socket")
        if sock is not None and not writer.transport.is_closing():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.stats["resets"] += 1
        writer.transport.abort()  # our own reader then sees EOF, which ends the connection

    async def handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1
        conn = self.stats["connections"]
        try:
            ureader, uwriter = await asyncio.open_connection(*self.upstream)
        except OSError:  # upstream refused: the client sees an RST
            return self.rst(cwriter)
        self.live.add(cwriter)
        # turn: the client spoke since the last response began; fresh: a request may begin now
        state = {"turn": True, "fresh": True, "stalled": False, "conn": conn}
        queue: asyncio.Queue = asyncio.Queue()
        down = asyncio.create_task(self.upstream_to_queue(ureader, queue, state))
        up = asyncio.create_task(self.client_to_upstream(creader, uwriter, state, queue, Bucket(self.conn_rate)))
        deliver = asyncio.create_task(self.queue_to_client(queue, cwriter, Bucket(self.conn_rate), state))
        try:
            await asyncio.wait([up, deliver], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (down, up, deliver):
                task.cancel()
            await asyncio.gather(down, up, deliver, return_exceptions=True)
            uwriter.transport.abort()
            cwriter.close()
            self.live.discard(cwriter)
            self.traced(state)

    async def client_to_upstream(self, creader, uwriter, state, queue, bucket: Bucket) -> None:
        """Forward requests undelayed (or answer one throttled); returns, ending the connection,
        when the client hangs up."""
        with contextlib.suppress(OSError):
            while data := await creader.read(65536):
                state["turn"] = True
                if state["fresh"] and not state["stalled"]:
                    state["fresh"] = False
                    self.stats["requests"] += 1
                    self.traced(state, data)
                    if data.startswith((b"GET ", b"HEAD ")) and self.rng.random() < self.settings["throttle_prob"]:
                        state["stalled"] = True  # nothing more goes upstream: the answer is ours
                        self.stats["throttled"] += 1
                        release = asyncio.get_running_loop().time() + self.settings["latency_ms"] / 1000
                        await queue.put((release, self.throttled(data.startswith(b"HEAD "))))
                        await queue.put((release, EOF))
                if not state["stalled"]:
                    await bucket.take(len(data))
                    self.stats["bytes_up"] += len(data)
                    uwriter.write(data)
                    await uwriter.drain()

    async def upstream_to_queue(self, ureader, queue, state) -> None:
        left = None  # bytes of this response still allowed before the RST
        loop = asyncio.get_running_loop()
        try:
            while data := await ureader.read(65536):
                delay = self.settings["latency_ms"] / 1000
                if state["turn"]:  # a new response begins
                    left, delay = self.new_response(state)
                release = loop.time() + delay  # in a tail, later chunks wait behind the first (a FIFO)
                if state["stalled"]:  # black hole: swallow everything, never close
                    continue
                if left is not None and len(data) > left:
                    await queue.put((release, data[:left]))
                    return await queue.put((release, RESET))
                if left is not None:
                    left -= len(data)
                await queue.put((release, data))
        except OSError:
            pass
        if not state["stalled"]:
            await queue.put((loop.time() + self.settings["latency_ms"] / 1000, EOF))

    def new_response(self, state: dict) -> tuple[int | None, float]:
        """Draw a new response's faults: (its bytes before an RST or None, its first byte's delay in s)."""
        state["turn"], state["fresh"] = False, True
        s, rng = self.settings, self.rng
        self.stats["responses"] += 1
        left = rng.randint(0, s["reset_max_bytes"]) if rng.random() < s["reset_prob"] else None
        if not state["stalled"] and rng.random() < s["stall_prob"]:
            state["stalled"] = True
            self.stats["stalls"] += 1
        # drawn only with a tail asked for, so a seed gives the resets and stalls it gave without tails
        if s["tail_prob"] > 0 and rng.random() < s["tail_prob"] and not state["stalled"]:
            self.stats["tailed"] += 1
            if "record" in state:
                state["record"]["tailed"] = True
            return left, s["tail_ms"] / 1000
        return left, s["latency_ms"] / 1000

    async def queue_to_client(self, queue, cwriter, bucket: Bucket, state: dict) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                release, item = await queue.get()
                if (delay := release - loop.time()) > 0:
                    await asyncio.sleep(delay)
                if item is EOF or item is RESET:
                    await cwriter.drain()
                    return self.rst(cwriter) if item is RESET else None
                if item:
                    await bucket.take(len(item))
                    cwriter.write(item)
                    self.stats["bytes"] += len(item)
                    if (record := state.get("record")) is not None:
                        record["first"] = record["first"] or time.time()
                        record["last"], record["bytes"] = time.time(), record["bytes"] + len(item)
                    await cwriter.drain()
        except OSError:  # the client went away
            return

    def throttled(self, head: bool) -> bytes:
        """The store's answer to too many requests: S3's 503 SlowDown or GCS's 429."""
        if self.settings["throttle_status"] == 429:
            reason, kind = "Too Many Requests", "application/json"
            body = json.dumps(
                {
                    "error": {
                        "code": 429,
                        "message": "The rate of requests is too high.",
                        "errors": [{"reason": "rateLimitExceeded"}],
                    }
                }
            ).encode()
        else:
            reason, kind = "Slow Down", "application/xml"
            body = (
                b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message></Error>"
            )
        status = int(self.settings["throttle_status"])
        head_lines = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {0 if head else len(body)}"
            "\r\nConnection: close\r\n\r\n"
        )
        return head_lines.encode() + (b"" if head else body)

    def storm(self, seconds: float, prob: float) -> None:
        """throttle_prob `prob` for `seconds`, then back to what it was before the storm."""
        loop = asyncio.get_running_loop()
        if loop.time() >= self.storm_ends:  # not in a storm already: remember the calm value
            self.calm = self.settings["throttle_prob"]
        self.settings["throttle_prob"] = prob
        self.storm_ends = loop.time() + seconds
        loop.call_later(seconds, self.calm_down)

    def calm_down(self) -> None:
        if asyncio.get_running_loop().time() >= self.storm_ends - 1e-3:  # a later storm ends later
            self.settings["throttle_prob"] = self.calm

    def control(self, line: str) -> str:
        match line.split():
            case ["storm", seconds, prob]:
                self.storm(float(seconds), float(prob))
                return "ok"
            case ["stats"]:
                return json.dumps({**self.stats, "active": len(self.live), **self.settings})
            case ["trace", "off"]:
                if self.trace is not None:
                    self.trace.close()
                self.trace = None
                return "ok"
            case ["trace", path]:
                if self.trace is not None:
                    self.trace.close()
                self.trace = open(path, "a")  # noqa: SIM115 - kept open until `trace off`
                return "ok"
            case ["reset_all"]:
                for writer in list(self.live):
                    self.rst(writer)
                return "ok"
            case ["set", name, value] if name in SETTINGS:
                self.settings[name] = SETTINGS[name][0](value)  # ValueError: a bad value
                return "ok"
        raise ValueError(f"unknown command {line.strip()!r}")

    async def handle_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            line = (await reader.readline()).decode("utf-8", "replace")
            try:
                answer = self.control(line)
            except ValueError as e:
                answer = f"error {e}"
            writer.write(answer.encode() + b"\n")
            await writer.drain()
        writer.close()


async def main(args: argparse.Namespace) -> None:
    host, _, port = args.upstream.rpartition(":")
    settings = {k: getattr(args, k) for k in SETTINGS}
    proxy = Proxy((host or "127.0.0.1", int(port)), random.Random(args.seed), **settings)
    server = await asyncio.start_server(proxy.handle, args.host, args.port)
    control = await asyncio.start_server(proxy.handle_control, args.host, args.control_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port, cport = (s.sockets[0].getsockname()[1] for s in (server, control))
    print(f"ready {port} {cport}", flush=True)
    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:  # bounded: also stop when the parent is gone
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    server.close()
    control.close()
    for writer in list(proxy.live):
        writer.transport.abort()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT to forward to")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--control-port", type=int, default=0)
    for name, (kind, text) in SETTINGS.items():  # --latency-ms, --conn-mbps, --tail-prob, ...
        default = kind(DEFAULTS.get(name, 0))
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=f"{text} (default {default})")
    p.add_argument("--seed", type=int, default=None, help="seed of the draws (faults, tails): a run repeats")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
