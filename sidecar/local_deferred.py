"""Releases off the critical path, for `sidecar.local_client.LocalClient`: whether a read
lease can be vouched for without waiting for its release's answer (`still_valid`), and the
queue of the releases so vouched for (`ReleaseQueue`).

With `defer_releases=True` (the vLLM connector) a read lease whose copies are done is
trusted without waiting for its release's answer when it is still valid beyond doubt
(`still_valid`: its generation is the mapped region's, the connection it came on is still
the open one and shows no hang-up, and the copies ended well inside the sidecar's
`lease_timeout_s` counted from before the lease was asked for); its release is then
queued (`ReleaseQueue.put`) and rides on the next request to the sidecar (its `release`
list: `ReleaseQueue.take`), or goes on its own once nothing else went out for
`flush_after_s` (the queue's flusher thread, `flush`), and at `close`. Otherwise `release`
waits for the answer, as without it. Why that is safe: docs/sidecar.md, "Invariants of
the local path" (8).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ctxcache import tracing
from sidecar.local_region import ReadLease, Region

TRUST_SHARE = 0.5  # a copy is trusted unanswered only if it ended within this share of
# the lease timeout, counted from before the lease was asked for
FLUSH_AFTER_S = 0.005  # a queued release goes on its own after this long without a request
_HANGUP = (
    select.POLLIN
    | select.POLLPRI
    | select.POLLERR
    | select.POLLHUP
    | getattr(select, "POLLRDHUP", 0)
)
_NONE: list[dict[str, Any]] = []  # (`take` of an empty queue: never appended to)


def still_valid(
    lease: ReadLease,
    *,
    sock: socket.socket | None,
    conn: int,
    region: Region | None,
    lease_timeout_s: float | None,
) -> bool:
    """(The copies done.) Whether `lease` holds now without asking: of the mapped
    generation (`region`), granted on the connection that is still open (`sock`, the
    client's `conn`-th), that connection showing no hang-up (a sidecar that stops, dies or
    times a read lease out closes it first), and young enough that it cannot have timed
    out (the sidecar's `lease_timeout_s`)."""
    if sock is None or lease.conn != conn or lease_timeout_s is None:
        return False
    if region is None or lease.region is not region or region.generation != lease.generation:
        return False
    if time.monotonic() - lease.sent >= lease_timeout_s * TRUST_SHARE:
        return False
    poll = select.poll()
    poll.register(sock, _HANGUP)
    try:
        return not poll.poll(0)
    except OSError:
        return False


class ReleaseQueue:
    """Releases of trusted read leases, not yet sent. Its own lock guards the queue; what
    sends them is `send(entries)` (the client's: one round trip, never raising), called
    without that lock held. Entries are `{"lease", "generation"[, "trace"]}`."""

    def __init__(
        self, send: Callable[[list[dict[str, Any]]], None], flush_after_s: float = FLUSH_AFTER_S
    ) -> None:
        self._send = send
        self.flush_after_s = flush_after_s
        self.queued = 0  # releases queued so far (each one trusted without its answer)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: list[dict[str, Any]] = []
        self._since = 0.0  # when the oldest queued release was queued
        self._flusher: threading.Thread | None = None
        self._flush_at: float | None = None  # when the flusher looks next (None: at a put)
        self._closed = False

    def put(self, lease: int, generation: str) -> None:
        """Queue a trusted lease's release, for the next request or a flush."""
        entry: dict[str, Any] = {"lease": lease, "generation": generation}
        if trace := tracing.carrier():
            entry["trace"] = trace  # the sidecar's span of it joins the load's trace
        with self._lock:
            if not self._pending:
                self._since = time.monotonic()
            self._pending.append(entry)
            self.queued += 1
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_loop, name="ctxcache-release", daemon=True
                )
                self._flusher.start()
            if self._flush_at is None:  # the flusher waits for work: tell it when to look
                self._flush_at = self._since + self.flush_after_s
                self._wake.notify()

    def take(self) -> list[dict[str, Any]]:
        """Everything queued, for a request to carry (the caller sends it). An empty
        queue is seen without the lock: a release queued meanwhile goes with the next."""
        if not self._pending:
            return _NONE
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def flush(self) -> None:
        """Send the queued releases now (one round trip)."""
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            self._send(pending)

    def close(self, timeout: float) -> None:
        """Stop the flusher (what is still queued stays: `flush` first to send it)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.join(timeout)

    def _flush_loop(self) -> None:
        """(Its own thread.) Send queued releases that no request took along in time."""
        while True:
            with self._lock:
                due = self._due()
            if due is None:
                return
            self._send(due)

    def _due(self) -> list[dict[str, Any]] | None:
        """(Under the lock.) Wait until the oldest queued release is due, and take the
        queue; None once closed. It looks at `_flush_at`, never earlier than the oldest
        queued release is due: loads whose requests keep taking the queue along wake it
        once per `flush_after_s`, not once per load (a thread switch and a contended lock
        each, measured: +15 µs a load)."""
        while not self._closed:
            if self._flush_at is None:
                self._wake.wait()
                continue
            left = self._flush_at - time.monotonic()
            if left > 0:
                self._wake.wait(left)
                continue
            due = self._since + self.flush_after_s
            if not self._pending:  # requests took them along: wait for the next put
                self._flush_at = None
            elif due > time.monotonic():  # queued again since
                self._flush_at = due
            else:
                self._flush_at = None
                pending, self._pending = self._pending, []
                return pending
        return None
