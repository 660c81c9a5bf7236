"""The local data path: a Unix socket that hands out places in the shared region.

An engine on this node (same pod, same compose project) maps the region (`sidecar.arena`)
once and talks to this socket; the payload never crosses it. Its messages (one JSON
document per line each way) are `sidecar.local_protocol`'s.

**Leases** (docs/sidecar.md, "Invariants of the local path") belong to the engine's client,
not to a connection, and carry random 64-bit ids (no two sidecars hand out the same one).
- A **read lease** holds references to its slots, so the store may evict or overwrite the
  blocks meanwhile but the slots are not reused: what the engine copies is the block as it
  was. It ends at its release, after `lease_timeout_s`, or when its client is gone; a
  release after that (or of another generation) answers `ok: false`, and the engine
  treats its copies as a miss. A read lease that times out first closes the connection
  it was granted on (`expire`): a client that trusts its copies without waiting for the
  release's answer checks that connection (`sidecar.local_deferred.still_valid`).
- A **write lease** (`alloc`) gives slots to one writer. They are handed to nobody else
  until that writer can no longer write to them: its commit or abort (even after the
  lease ended, even to the next sidecar: the region's write table, `sidecar.arena`), or its
  client provably gone (its lock let go, or removed by its clean close). A lease past its
  timeout only stops its commit from storing anything; a commit refused as a bad request
  leaves the lease open (`LeaseTable`'s rule).

Here: the socket, its connections, `hello`, the dispatch of requests and the periodic
sweep of idle connections (`expire`). The leases and clients, what the lease requests do
to them, and the rule that keeps a write slot from anyone else while its writer can write,
are one object's: `sidecar.local_leases.LeaseTable` (`LocalServer.table`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxcache import tracing
from sidecar.arena import Arena
from sidecar.arena_dir import DIR_LOCK, SOCKET_NAME, ensure_directory
from sidecar.local_leases import ANONYMOUS, LeaseTable
from sidecar.local_protocol import (
    MAX_LINE,
    TOKEN,
    decode,
    encode,
    release_list,
    strings,
)
from sidecar.metrics import SidecarMetrics
from sidecar.store import BlockStore

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # past it, the longest idle connection is closed for a new one
IDLE_TIMEOUT_S = 600.0  # a connection silent this long is closed (its leases stay)


class LocalDirInUse(RuntimeError):
    """Another live sidecar uses this directory."""


@dataclass
class Conn:
    sock: socket.socket
    client: str
    last: float = field(default_factory=time.monotonic)
    busy: bool = False


class LocalServer:
    """The local socket: its connections and the dispatch of their requests, to `hello`
    and `exists` here and to the lease table (`table`) for the rest."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        *,
        lease_timeout_s: float,
        max_block_bytes: int,
        metrics: SidecarMetrics,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.store, self.arena, self.metrics = store, arena, metrics
        self.idle_timeout_s = idle_timeout_s
        self.table = LeaseTable(
            store,
            arena,
            metrics,
            lease_timeout_s=lease_timeout_s,
            max_block_bytes=max_block_bytes,
            silent_writer_s=max(20 * lease_timeout_s, idle_timeout_s),
            hang_up=self._hang_up,
        )
        self.path = arena.directory / SOCKET_NAME
        self._lock = threading.Lock()  # the connections'
        self._conns: dict[int, Conn] = {}
        self._next_conn = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.path.unlink(missing_ok=True)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o660)
        self._listener.listen(1024)  # (capped by net.core.somaxconn)
        self._thread = threading.Thread(target=self._accept_loop, name="local-accept", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()
        log.info("local data path on %s (region %s)", self.path, self.arena.path)

    def stop(self) -> int:
        """Stop serving; how many engines were connected (each maps the region)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)
        return len(conns)

    def expire(self, now: float | None = None) -> int:
        """The periodic sweep: the lease table's (`LeaseTable.expire`: leases past their
        timeout, gone writers), then connections idle past `idle_timeout_s` are closed.
        Returns how many leases timed out."""
        now = time.monotonic() if now is None else now
        ended = self.table.expire(now)
        with self._lock:
            idle = [
                c.sock
                for c in self._conns.values()
                if not c.busy and now - c.last > self.idle_timeout_s
            ]
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        return ended

    @property
    def leases(self) -> int:
        return len(self.table)

    @property
    def released_batched(self) -> int:
        """Read leases released by a `release` list on a request."""
        return self.table.released_batched

    @property
    def lease_timeout_s(self) -> float:
        return self.table.lease_timeout_s

    @lease_timeout_s.setter
    def lease_timeout_s(self, value: float) -> None:
        self.table.lease_timeout_s = value  # (leases granted from now on)

    def _hang_up(self, cid: int) -> None:
        """(The table's, under its lock.) Close connection `cid`, if it is still open."""
        with self._lock:
            conn = self._conns.get(cid)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    # ---- connections ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                log.warning("local socket accept failed: %s", exc)  # (EMFILE...): go on
                time.sleep(0.05)
                continue
            try:
                self._admit(sock)
            except Exception:
                log.exception("could not serve a local connection")
                with contextlib.suppress(OSError):
                    sock.close()

    def _admit(self, sock: socket.socket) -> None:
        """Serve `sock` on a thread of its own; at the connection cap the longest idle
        connection is closed first (its client reconnects when it next calls; its leases
        are its client's, not the connection's, and stay)."""
        with self._lock:
            self._next_conn += 1
            cid = self._next_conn
            victim = None
            if len(self._conns) >= MAX_CONNECTIONS:
                idle = [c for c in self._conns.values() if not c.busy]
                if idle:
                    victim = min(idle, key=lambda c: c.last).sock
            self._conns[cid] = Conn(sock, f"{ANONYMOUS}{cid}")
        if victim is not None:
            self.metrics.local_connections_evicted.inc()
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)
        try:
            threading.Thread(
                target=self._serve, args=(cid, sock), name="local-conn", daemon=True
            ).start()
        except BaseException:
            with self._lock:
                self._conns.pop(cid, None)
            raise

    def _serve(self, cid: int, sock: socket.socket) -> None:
        self.metrics.local_connections.inc()
        reader = sock.makefile("rb")
        try:
            while True:
                line = reader.readline(MAX_LINE + 1)
                if not line or len(line) > MAX_LINE:
                    return
                with self._lock:
                    conn = self._conns[cid]
                    conn.busy = True
                reply = self._answer(cid, line)
                sock.sendall(encode(reply))
                with self._lock:
                    conn.busy, conn.last = False, time.monotonic()
        except OSError as exc:
            log.debug("local connection closed: %s", exc)
        except Exception:
            log.exception("local connection failed")
        finally:
            self.metrics.local_connections.dec()
            with self._lock:
                conn = self._conns.pop(cid, None)
            reader.close()
            sock.close()
            if conn is not None:
                self.table.disconnected(conn.client)

    # ---- requests ---------------------------------------------------------------------
    def _answer(self, cid: int, line: bytes) -> dict[str, Any]:
        """One request's reply; whatever the request, an answer (never an exception)."""
        try:
            return self._handle(cid, decode(line))
        except Exception as exc:  # a malformed request: refused, the connection serves on
            return {"ok": False, "error": f"bad request: {type(exc).__name__}"}

    def _handle(self, cid: int, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        table = self.table
        handler = {
            "hello": self._hello,
            "lease": table.lease,
            "release": table.release,
            "alloc": table.alloc,
            "commit": table.commit,
            "abort": table.abort,
            "exists": self._exists,
        }.get(op)
        if handler is None:
            return {"ok": False, "error": f"unknown op {str(op)[:32]!r}"}
        self.metrics.local_requests.labels(op).inc()
        with self._lock:
            token = self._conns[cid].client
        self.table.seen(token)
        released = None
        if "release" in req:  # read leases the client is done with: released first
            released = self.table.release_batch(token, release_list(req["release"]))
        reply = self._traced(cid, token, req, handler)
        if released is not None:
            reply["released"] = released
        return reply

    def _traced(self, cid: int, token: str, req: dict[str, Any], handler: Any) -> dict[str, Any]:
        op = req["op"]
        trace = req.get("trace")
        if not tracing.enabled() or not isinstance(trace, dict):
            return handler(cid, token, req)
        carrier = {str(k): str(v) for k, v in trace.items()}
        with tracing.span_in(carrier, f"sidecar local {op}", server=True):
            return handler(cid, token, req)

    def _hello(self, cid: int, token: str, req: dict[str, Any]) -> dict[str, Any]:
        name = req.get("client")
        if name is not None:
            if not isinstance(name, str) or not TOKEN.fullmatch(name):
                raise ValueError("client")
            with self._lock:
                conn = self._conns[cid]
                old, conn.client = conn.client, name
            self.table.hello(old, name, lock=bool(req.get("lock")))
        return {
            "ok": True,
            "generation": self.arena.generation,
            "region": str(self.arena.path),
            "size": self.arena.size,
            "lease_timeout_s": self.table.lease_timeout_s,
            "release_batch": True,  # any request may carry `release` (the module's doc)
        }

    def _exists(self, cid: int, token: str, req: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "found": [self.store.exists(k) for k in strings(req["keys"])]}


def claim_directory(directory: Path) -> int:
    """Hold `directory` for this sidecar (an `flock` on `sidecar.lock`, let go when the
    process ends, however it ends); raise LocalDirInUse when another live sidecar holds
    it. Returns the descriptor to keep open."""
    ensure_directory(directory)
    path = directory / DIR_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LocalDirInUse(
            f"another sidecar serves {directory}; give each sidecar its own --local-dir"
        ) from None
    return fd


__all__ = ["LocalDirInUse", "LocalServer", "claim_directory"]
