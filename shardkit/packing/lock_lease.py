"""An object store's DEST lock: an object written conditionally, held by a lease.

On S3, GCS and Azure the lock is an object, created only where there is none (`If-None-Match: *`,
`ifGenerationMatch=0`: of two packs starting together one creates it, the other is refused)
and held by a lease: the holder rewrites it every quarter of the lease (LEASE_S, 2 minutes
by default; `SHARDKIT_LOCK_LEASE_S` sets it for the packs a process starts), each time
conditional on the version it wrote last, from a daemon thread. A lock that has gone a
whole lease without a rewrite, by the clock of the pack that finds it, or whose holder was a
process of this machine that is gone, is stale: it is taken over by a conditional replace
of the version read (`If-Match` the ETag, `ifGenerationMatch` the generation), so of two
packs taking it over only one succeeds. So a rerun on the machine of a killed pack starts at
once; elsewhere it starts once the dead pack's lease has run out (the refusal says when).
The clocks of the machines packing into one bucket must agree to well within a lease (NTP
does). A holder that finds its lock taken over (its lease ran out while the store could not
be reached, say) stops before it commits an index, and lets the lock be. It is removed as
the pack ends, conditional on its version.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from .. import storage
from ..errors import DestinationBusyError, ShardkitError
from ..storage.stores import Store

_TAKE_TRIES = 5  # looks at a lock that changed hands between a read and a conditional write
log = logging.getLogger("shardkit")


class Holding:
    """What a pack holds on DEST: `check()` (cheap, as each job ends) and `confirm()` (before
    the index is committed) raise DestinationBusyError once another pack has taken it over.
    A local lock cannot be taken over: nothing to do."""

    def check(self) -> None:
        pass

    def confirm(self) -> None:
        pass


class Lease(Holding):
    """The lock object `url` of an object store's DEST, taken (`take`), refreshed from a daemon
    thread every quarter of `lease_s`, checked, and released."""

    def __init__(self, store: Store, url: str, dest: str, lease_s: float):
        self.store, self.url, self.dest, self.lease_s = store, url, dest, lease_s
        self.note = {
            "run": uuid.uuid4().hex,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "lease_s": lease_s,
            **_process(),
        }
        self.version: str | None = None
        self.lost: str | None = None  # who took it over, once someone has
        self._refreshed = 0.0  # time.monotonic() of the last write that held
        self._guard = threading.Lock()  # one write at a time: the thread's, confirm()'s or release()'s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _encoded(self) -> bytes:
        return json.dumps({**self.note, "refreshed": time.time()}).encode()

    def take(self) -> None:
        """Create the lock, or take over a stale one; DestinationBusyError naming a live holder."""
        for _ in range(_TAKE_TRIES):
            version = self.store.put_if_absent(self.url, self._encoded())
            if version is None:
                version = self._over()
            if version is not None:
                self.version, self._refreshed = version, time.monotonic()
                self._thread = threading.Thread(target=self._refreshing, name="shardkit-lock", daemon=True)
                self._thread.start()
                return
        raise DestinationBusyError(
            f"{self._where()}: its lock {storage.display(self.url)} changed hands "
            f"{_TAKE_TRIES} times while this pack looked: other packs are starting there"
        )

    def _over(self) -> str | None:
        """The version this pack holds after finding a lock there: its own (a write whose
        answer was lost), or a stale one's, taken over; None to look again (it changed)."""
        found = self.store.read_versioned(self.url)
        if found is None:
            return None  # released meanwhile
        raw, seen = found
        holder = _parsed(raw)
        if holder is None:
            raise DestinationBusyError(
                f"{self._where()}: {storage.display(self.url)} is there but is no pack's lock "
                "note: remove it if no pack is writing into it"
            )
        if holder.get("run") == self.note["run"]:
            return seen
        stale = _stale(holder)
        if stale is None:
            raise DestinationBusyError(
                f"{self._where()}: another pack is writing into it ({_who(holder)}; it holds "
                f"{storage.display(self.url)}): wait for it to end, or pack into another "
                f"prefix; {_until(holder)}"
            )
        version = self.store.replace_if(self.url, self._encoded(), seen)
        if version is not None:
            log.warning("%s: took over the lock of a pack gone (%s; %s)", self._where(), _who(holder), stale)
        return version

    def _where(self) -> str:
        return storage.display(self.dest)

    def _refreshing(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            self._refresh()  # a take-over it finds is told by check() and confirm()

    def _refresh(self) -> None:
        """Rewrite the lock, conditional on the version written last; note a take-over."""
        with self._guard:
            if self.lost is not None or self.version is None:
                return
            try:
                version = self.store.replace_if(self.url, self._encoded(), self.version)
                if version is None:  # another pack's version, or ours with its answer lost on the way
                    found = self.store.read_versioned(self.url)
                    holder = _parsed(found[0]) if found is not None else None
                    if found is not None and holder is not None and holder.get("run") == self.note["run"]:
                        version = found[1]
                    else:
                        self.lost = _who(holder) if holder is not None else "and let it go since"
                        log.error(
                            "%s: another pack took over this pack's lock (%s): this pack stops",
                            self._where(),
                            self.lost,
                        )
                        return
            except (ShardkitError, OSError) as e:
                left = self.lease_s - (time.monotonic() - self._refreshed)
                log.warning(
                    "%s: could not refresh this pack's lock (%s); another pack may take it over in %.0f s",
                    self._where(),
                    e,
                    max(0.0, left),
                )
                return
            self.version, self._refreshed = version, time.monotonic()

    def check(self) -> None:
        if self.lost is not None:
            raise DestinationBusyError(
                f"{self._where()}: another pack took this pack's lock over ({self.lost}) after "
                f"{self.lease_s:.0f} s without a refresh: this pack stopped; rerun it once "
                "that one has ended"
            )

    def confirm(self) -> None:
        """Refresh the lock now, and raise unless it still holds it for a while to come."""
        self._refresh()
        self.check()
        if time.monotonic() - self._refreshed > self.lease_s / 2:
            raise DestinationBusyError(
                f"{self._where()}: could not refresh this pack's lock "
                f"{storage.display(self.url)} for {time.monotonic() - self._refreshed:.0f} s "
                f"(of its lease of {self.lease_s:.0f} s): not committing; rerun the pack"
            )

    def release(self) -> None:
        """Stop refreshing, and remove the lock if it is still this pack's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._guard:
            version, self.version = self.version, None
            if self.lost is not None or version is None:
                return
            try:
                self.store.remove_if(self.url, version)
            except (ShardkitError, OSError) as e:
                log.warning(
                    "%s: could not remove this pack's lock (%s): the next pack takes it over once its "
                    "lease of %.0f s has run out",
                    self._where(),
                    e,
                    self.lease_s,
                )


def _parsed(raw: bytes) -> dict[str, Any] | None:
    """A lock's note, if it is one."""
    try:
        note = json.loads(raw)
    except ValueError:
        return None
    fields = {"run": str, "pid": int, "host": str, "since": str}
    if not (
        isinstance(note, dict)
        and all(isinstance(note.get(k), t) for k, t in fields.items())
        and isinstance(note.get("refreshed"), (int, float))
        and isinstance(note.get("lease_s"), (int, float))
    ):
        return None
    return note


def _who(note: dict[str, Any]) -> str:
    return f"run {note['run'][:12]}, pid {note['pid']} on {note['host']}, since {note['since']}"


def _age(note: dict[str, Any]) -> float:
    return time.time() - float(note["refreshed"])


def _stale(note: dict[str, Any]) -> str | None:
    """Why a lock is stale (None: its holder may be alive)."""
    if _gone(note):
        return f"its process {note['pid']} on this machine has ended"
    if _age(note) > float(note["lease_s"]):
        return f"not refreshed for {_age(note):.0f} s, over its lease of {float(note['lease_s']):.0f} s"
    return None


def _until(note: dict[str, Any]) -> str:
    left = float(note["lease_s"]) - _age(note)
    return (
        f"it was refreshed {max(0.0, _age(note)):.0f} s ago: a pack that died is taken over once its lease "
        f"has run out, in {max(0.0, left):.0f} s"
    )


# A process's identity on this machine: the kernel's boot id and pid namespace (a machine's,
# not a container's hostname: two containers can share one) and its start time (a pid can be
# reused), where /proc tells them (Linux); elsewhere a lock is stale only when its lease runs out.


def _process() -> dict[str, str]:
    machine, started = _machine(), _started(os.getpid())
    return {"machine": machine, "started": started} if machine is not None and started is not None else {}


def _machine() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _started(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), the name (field 2) aside
    except (OSError, IndexError):
        return None


def _gone(note: dict[str, Any]) -> bool:
    """Whether the lock's holder was a process of this machine that is no longer running."""
    here = _machine()
    return here is not None and note.get("machine") == here and _started(int(note["pid"])) != note.get("started")
