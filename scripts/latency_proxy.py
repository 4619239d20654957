"""A TCP proxy that delays, resets, stalls or throttles server->client traffic (stdlib only, own process).

    python scripts/latency_proxy.py --upstream 127.0.0.1:9000 --latency-ms 50

Each upstream chunk is released ``latency_ms`` after it arrives: a pipelined delay line (first byte
late, throughput kept; it buffers without bound).  A response starts at the first upstream byte
after the client sent something; with ``reset_prob`` it gets an RST after a uniform 0..N of its
bytes (no fault if shorter), with ``stall_prob`` the connection is black-holed.  With ``throttle_prob``
a GET or HEAD is not forwarded: the proxy answers it itself, ``throttle_status`` 503 as S3 does
(``SlowDown``, XML) or 429 as GCS does (``rateLimitExceeded``, JSON), and closes the connection.
Prints ``ready PORT CONTROL_PORT``; the control port takes one line per connection: ``set latency_ms
100``, ``set reset_prob 0.05``, ``storm SECONDS PROB`` (throttle_prob PROB for SECONDS, then back),
``reset_all`` or ``stats`` (JSON).  Exits on SIGTERM/SIGINT or when its parent dies.
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

SETTINGS = {"latency_ms": float, "reset_prob": float, "reset_max_bytes": int, "stall_prob": float,
            "throttle_prob": float, "throttle_status": int}
DEFAULTS = {"throttle_status": 503}
RESET = object()  # queue marker: send an RST to the client
EOF = object()  # queue marker: upstream closed


class Proxy:
    def __init__(self, upstream: tuple[str, int], rng: random.Random, **settings: float) -> None:
        self.upstream, self.rng, self.settings = upstream, rng, settings
        self.live: set[asyncio.StreamWriter] = set()
        self.stats = {"connections": 0, "resets": 0, "stalls": 0, "throttled": 0, "requests": 0, "bytes": 0,
                      "bytes_up": 0}
        self.storm_ends, self.calm = 0.0, 0.0  # loop time the current storm ends, throttle_prob after it

    def rst(self, writer: asyncio.StreamWriter) -> None:
        """Close with SO_LINGER 0, so the kernel sends an RST instead of a FIN."""
        sock = writer.get_extra_info("socket")
        if sock is not None and not writer.transport.is_closing():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.stats["resets"] += 1
        writer.transport.abort()  # our own reader then sees EOF, which ends the connection

    async def handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1
        try:
            ureader, uwriter = await asyncio.open_connection(*self.upstream)
        except OSError:  # upstream refused: the client sees an RST
            return self.rst(cwriter)
        self.live.add(cwriter)
        # turn: the client spoke since the last response began; fresh: a request may begin now
        state = {"turn": True, "fresh": True, "stalled": False}
        queue: asyncio.Queue = asyncio.Queue()
        down = asyncio.create_task(self.upstream_to_queue(ureader, queue, state))
        up = asyncio.create_task(self.client_to_upstream(creader, uwriter, state, queue))
        deliver = asyncio.create_task(self.queue_to_client(queue, cwriter))
        try:
            await asyncio.wait([up, deliver], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (down, up, deliver):
                task.cancel()
            await asyncio.gather(down, up, deliver, return_exceptions=True)
            uwriter.transport.abort()
            cwriter.close()
            self.live.discard(cwriter)

    async def client_to_upstream(self, creader, uwriter, state, queue) -> None:
        """Forward requests undelayed (or answer one throttled); returns, ending the connection,
        when the client hangs up."""
        with contextlib.suppress(OSError):
            while data := await creader.read(65536):
                state["turn"] = True
                if state["fresh"] and not state["stalled"]:
                    state["fresh"] = False
                    self.stats["requests"] += 1
                    if data.startswith((b"GET ", b"HEAD ")) and self.rng.random() < self.settings["throttle_prob"]:
                        state["stalled"] = True  # nothing more goes upstream: the answer is ours
                        self.stats["throttled"] += 1
                        release = asyncio.get_running_loop().time() + self.settings["latency_ms"] / 1000
                        await queue.put((release, self.throttled(data.startswith(b"HEAD "))))
                        await queue.put((release, EOF))
                if not state["stalled"]:
                    self.stats["bytes_up"] += len(data)
                    uwriter.write(data)
                    await uwriter.drain()

    async def upstream_to_queue(self, ureader, queue, state) -> None:
        left = None  # bytes of this response still allowed before the RST
        loop = asyncio.get_running_loop()
        try:
            while data := await ureader.read(65536):
                release = loop.time() + self.settings["latency_ms"] / 1000
                if state["turn"]:  # a new response begins
                    state["turn"], state["fresh"] = False, True
                    s = self.settings
                    left = self.rng.randint(0, s["reset_max_bytes"]) if self.rng.random() < s["reset_prob"] else None
                    if not state["stalled"] and self.rng.random() < s["stall_prob"]:
                        state["stalled"] = True
                        self.stats["stalls"] += 1
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

    async def queue_to_client(self, queue, cwriter) -> None:
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
                    cwriter.write(item)
                    self.stats["bytes"] += len(item)
                    await cwriter.drain()
        except OSError:  # the client went away
            return

    def throttled(self, head: bool) -> bytes:
        """The store's answer to too many requests: S3's 503 SlowDown or GCS's 429."""
        if self.settings["throttle_status"] == 429:
            reason, kind = "Too Many Requests", "application/json"
            body = json.dumps({"error": {"code": 429, "message": "The rate of requests is too high.",
                                         "errors": [{"reason": "rateLimitExceeded"}]}}).encode()
        else:
            reason, kind = "Slow Down", "application/xml"
            body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                    b"<Message>Please reduce your request rate.</Message></Error>")
        status = int(self.settings["throttle_status"])
        head_lines = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {0 if head else len(body)}"
                      "\r\nConnection: close\r\n\r\n")
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
            case ["reset_all"]:
                for writer in list(self.live):
                    self.rst(writer)
                return "ok"
            case ["set", name, value] if name in SETTINGS:
                self.settings[name] = SETTINGS[name](value)  # ValueError: a bad value
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
    for name, kind in SETTINGS.items():  # --latency-ms, --reset-prob, --reset-max-bytes, --stall-prob
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=kind(DEFAULTS.get(name, 0)))
    p.add_argument("--seed", type=int, default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
