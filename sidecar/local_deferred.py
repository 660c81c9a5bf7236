"""Releases off the critical path: the part of `sidecar.local_client.LocalClient` (a base of
it, `DeferredReleases`; the client's lock and connection are its) that vouches for a read
lease without waiting for its release's answer and sends the release later.

With `defer_releases=True` (the vLLM connector) a read lease whose copies are done is
trusted without waiting for its release's answer when it is still valid beyond doubt
(`_trusted`: its generation is the mapped region's, the connection it came on is still the
open one and shows no hang-up, and the copies ended well inside the sidecar's
`lease_timeout_s` counted from before the lease was asked for); its release is then
queued (`_queue`) and rides on the next request to the sidecar (its `release` list), or
goes on its own once nothing else went out for `flush_after_s` (`_flush_loop`, `flush`),
and at `close`. Otherwise `release` waits for the answer, as without it. Why that is safe:
docs/sidecar.md, "Invariants of the local path" (8).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from ctxcache import tracing
from sidecar.local_protocol import LocalError
from sidecar.local_region import Lease, Region

log = logging.getLogger(__name__)

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


class DeferredReleases:
    """Trusted releases, queued and flushed (a base of `LocalClient`: the state below is its)."""

    _lock: threading.RLock
    _wake: threading.Condition
    _sock: socket.socket | None
    _conn: int
    region: Region | None
    _lease_timeout: float | None
    _batch_ok: bool
    _closed: bool
    flush_after_s: float
    _pending: list[dict[str, Any]]
    _pending_since: float
    _flusher: threading.Thread | None
    _flush_at: float | None
    trusted_releases: int
    _call: Callable[..., dict[str, Any]]

    def _trusted(self, lease: Lease) -> bool:
        """(Under the lock, the copies done.) Whether `lease` holds now without asking: of
        the mapped generation, granted on the connection that is still open, that
        connection showing no hang-up (a sidecar that stops, dies or times a read lease
        out closes it first), and young enough that it cannot have timed out."""
        sock, region, limit = self._sock, self.region, self._lease_timeout
        if sock is None or lease.conn != self._conn or limit is None:
            return False
        if region is None or lease.region is not region or region.generation != lease.generation:
            return False
        if time.monotonic() - lease.sent >= limit * TRUST_SHARE:
            return False
        poll = select.poll()
        poll.register(sock, _HANGUP)
        try:
            return not poll.poll(0)
        except OSError:
            return False

    def _queue(self, req: dict[str, Any]) -> None:
        """(Under the lock.) A trusted lease's release, for the next request or a flush."""
        entry = {"lease": req["lease"], "generation": req["generation"]}
        if trace := tracing.carrier():
            entry["trace"] = trace  # the sidecar's span of it joins the load's trace
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.append(entry)
        self.trusted_releases += 1
        if self._flusher is None:
            self._flusher = threading.Thread(
                target=self._flush_loop, name="ctxcache-release", daemon=True
            )
            self._flusher.start()
        if self._flush_at is None:  # the flusher waits for work: tell it when to look
            self._flush_at = self._pending_since + self.flush_after_s
            self._wake.notify()

    def _flush_loop(self) -> None:
        """(Its own thread.) Send queued releases that no request took along in time. It
        looks at `_flush_at`, never earlier than the oldest queued release is due: loads
        whose requests keep taking the queue along wake it once per `flush_after_s`, not
        once per load (a thread switch and a contended lock each, measured: +15 µs a load)."""
        with self._lock:
            while not self._closed:
                if self._flush_at is None:
                    self._wake.wait()
                    continue
                left = self._flush_at - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                due = self._pending_since + self.flush_after_s
                if not self._pending:  # requests took them along: wait for the next queue
                    self._flush_at = None
                elif due > time.monotonic():  # queued again since
                    self._flush_at = due
                else:
                    self._flush_at = None
                    self.flush()

    def flush(self) -> None:
        """Send the queued releases now (one round trip). Never raises: a sidecar that is
        gone took its leases with it."""
        with self._lock:
            pending, self._pending = self._pending, []
            if self.region is not None:  # another generation's leases died with it
                pending = [e for e in pending if e["generation"] == self.region.generation]
            if not pending:
                return
            first, rest = pending[0], pending[1:]
            reqs = [{"op": "release", **first}]
            if rest and self._batch_ok:
                reqs[0]["release"] = rest
            elif rest:
                reqs += [{"op": "release", **e} for e in rest]
            for req in reqs:
                try:
                    self._call(req, retry=True, check=False)
                except LocalError as exc:
                    log.debug("queued releases not sent (%s): the sidecar is gone", exc)
                    return
