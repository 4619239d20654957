"""Real storage servers on loopback, for the tests (a pytest plugin: `fixtures`, with
`store_fixtures` and `azurite`) and the benchmarks (bench/), which start them the same way:
one copy of each start-up, in the modules free of pytest (`process`: a server process, its
log, its waits; `moto`, `seaweed`, `fakegcs`, `proxy`: the latency proxy, latency_proxy.py,
in front of any of them; webhdfs_server.py). `threaded` serves HTTP handlers of the tests'
own in a thread."""

from __future__ import annotations

from .process import BIN, BUCKET, free_port, http
from .proxy import PROXY_OPTIONS, ProxyControl
from .threaded import recording, self_signed, serving

__all__ = ["BIN", "BUCKET", "PROXY_OPTIONS", "ProxyControl", "free_port", "http", "recording", "self_signed", "serving"]
