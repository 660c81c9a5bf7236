"""The local data path: a Unix socket that hands out places in the shared region.

An engine on this node (same pod, same compose project) maps the region (`sidecar.arena`)
once and talks to this socket; the payload never crosses it. One JSON document per line
each way, answered in order:

Requests, and what they answer:
- `{"op": "hello"}` -> `{"ok", "generation", "region", "size", "lease_timeout_s"}`
- `{"op": "lease", "keys": [...]}` -> `{"ok", "lease": id, "blocks": [...]}`, a block being
  null (a miss), "tcp" (present but no slot could be had: GET it over lm://) or
  `{"offset", "length", "fmt", "dtype", "shape"}`
- `{"op": "release", "lease": id}` -> `{"ok": true}` only if the lease held until now:
  then every byte copied under it was the block's
- `{"op": "alloc", "lengths": [...]}` -> `{"ok", "lease": id, "offsets": [...]}`, or
  `{"ok": false, "error": "full"}`
- `{"op": "commit", "lease": id, "blocks": [{"key", "fmt", "dtype", "shape"} or null]}` ->
  `{"ok", "stored": n}`: the allocated slots become blocks (null: the slot is given up)
- `{"op": "exists", "keys": [...]}` -> `{"ok", "found": [...]}`

Any request may carry `"trace": {"traceparent": ...}` (the engine's span, tracing on): the
sidecar's span of it (`sidecar local <op>`, with the bytes and blocks) joins that trace.

**Leases.** A lease holds references to its slots, so the store may evict or overwrite
the blocks meanwhile but the slots are not reused: what the engine copies is the block
as it was. A lease ends when it is released, when its connection closes (an engine that
died gives everything back) or after `lease_timeout_s` (a hung one); a release that comes
after that answers `ok: false`, and the engine treats its copies as a miss. So a copy that
raced an expiry, a restart (the connection is gone) or anything else is never used.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ctxcache import tracing
from sidecar.arena import SOCKET_NAME, Arena
from sidecar.blocks import BlockMeta
from sidecar.metrics import SidecarMetrics
from sidecar.protocol import MAX_KEY_LENGTH
from sidecar.store import BlockStore

log = logging.getLogger(__name__)

MAX_LINE = 1 << 20  # a request line longer than this closes the connection
MAX_KEYS = 4096  # keys or slots in one request


class LocalDirInUse(RuntimeError):
    """Another live sidecar answers on this directory's socket."""


@dataclass
class Lease:
    conn: int
    expires: float
    slots: list[Any] = field(default_factory=list)  # references that keep the slots
    lengths: list[int] = field(default_factory=list)  # (alloc) the requested lengths


class LocalServer:
    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        *,
        lease_timeout_s: float,
        max_block_bytes: int,
        metrics: SidecarMetrics,
    ) -> None:
        self.store, self.arena, self.metrics = store, arena, metrics
        self.max_block_bytes = max_block_bytes
        self.lease_timeout_s = lease_timeout_s
        self.path = arena.directory / SOCKET_NAME
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._conns: set[socket.socket] = set()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.path.unlink(missing_ok=True)
        self._listener.bind(str(self.path))
        os.chmod(self.path, 0o660)
        self._listener.listen(64)
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
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)
        return len(conns)

    def expire(self, now: float | None = None) -> int:
        """End the leases past their timeout; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [i for i, lease in self._leases.items() if lease.expires <= now]
            for i in gone:
                del self._leases[i]
        if gone:
            self.metrics.leases_expired.labels("timeout").inc(len(gone))
            log.warning("%d leases timed out; their holders' copies count as misses", len(gone))
        return len(gone)

    @property
    def leases(self) -> int:
        with self._lock:
            return len(self._leases)

    # ---- connections ------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="local-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        cid = next(self._conn_ids)
        self.metrics.local_connections.inc()
        reader = conn.makefile("rb")
        try:
            while True:
                line = reader.readline(MAX_LINE + 1)
                if not line or len(line) > MAX_LINE:
                    return
                try:
                    reply = self._handle(cid, json.loads(line))
                except (ValueError, TypeError, KeyError) as exc:
                    reply = {"ok": False, "error": f"bad request: {type(exc).__name__}"}
                conn.sendall(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
        except OSError as exc:
            log.debug("local connection closed: %s", exc)
        except Exception:
            log.exception("local connection failed")
        finally:
            self.metrics.local_connections.dec()
            with self._lock:
                self._conns.discard(conn)
            reader.close()
            conn.close()
            self._drop_connection(cid)

    def _drop_connection(self, cid: int) -> None:
        with self._lock:
            gone = [i for i, lease in self._leases.items() if lease.conn == cid]
            for i in gone:
                del self._leases[i]
        if gone:
            self.metrics.leases_expired.labels("disconnect").inc(len(gone))

    # ---- requests ---------------------------------------------------------------------
    def _handle(self, cid: int, req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        handler = {
            "hello": self._hello,
            "lease": self._lease,
            "release": self._release,
            "alloc": self._alloc,
            "commit": self._commit,
            "exists": self._exists,
        }.get(op)
        if handler is None:
            return {"ok": False, "error": f"unknown op {str(op)[:32]!r}"}
        self.metrics.local_requests.labels(op).inc()
        trace = req.get("trace")
        if not tracing.enabled() or not isinstance(trace, dict):
            return handler(cid, req)
        carrier = {str(k): str(v) for k, v in trace.items()}
        with tracing.span_in(carrier, f"sidecar local {op}", server=True):
            return handler(cid, req)

    def _hello(self, cid: int, req: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "generation": self.arena.generation,
            "region": str(self.arena.path),
            "size": self.arena.size,
            "lease_timeout_s": self.lease_timeout_s,
        }

    def _new_lease(self, cid: int, slots: list[Any], lengths: list[int]) -> int:
        lease_id = next(self._ids)
        with self._lock:
            expires = time.monotonic() + self.lease_timeout_s
            self._leases[lease_id] = Lease(cid, expires, slots, lengths)
        return lease_id

    def _take(self, cid: int, lease_id: object) -> Lease | None:
        with self._lock:
            lease = self._leases.get(lease_id) if isinstance(lease_id, int) else None
            if lease is None or lease.conn != cid:
                return None
            del self._leases[lease_id]  # type: ignore[arg-type]
        return lease if lease.expires > time.monotonic() else None

    def _lease(self, cid: int, req: dict[str, Any]) -> dict[str, Any]:
        keys = _strings(req["keys"])
        slots: list[Any] = []
        blocks: list[Any] = []
        leased = 0
        for key in keys:
            found = self.store.lease(key)
            if found is None:
                blocks.append(None)
                continue
            if found is False:
                blocks.append("tcp")
                continue
            meta, slot = found  # type: ignore[misc]
            offset = self.arena.offset(slot)  # type: ignore[arg-type]
            slots.append(slot)
            leased += meta.length
            blocks.append(
                {
                    "offset": offset,
                    "length": meta.length,
                    "fmt": meta.fmt,
                    "dtype": meta.dtype,
                    "shape": list(meta.shape),
                }
            )
        self.metrics.local_bytes.labels("load").inc(leased)
        lease_id = self._new_lease(cid, slots, []) if slots else 0
        tracing.annotate(
            {
                "ctxcache.kv.keys": len(keys),
                "ctxcache.kv.blocks_shm": len(slots),
                "ctxcache.kv.blocks_tcp": blocks.count("tcp"),
                "ctxcache.kv.bytes_shm": leased,
            }
        )
        return {"ok": True, "lease": lease_id, "blocks": blocks}

    def _release(self, cid: int, req: dict[str, Any]) -> dict[str, Any]:
        held = self._take(cid, req["lease"]) is not None
        tracing.annotate({"ctxcache.kv.lease_held": held})
        return {"ok": held}

    def _alloc(self, cid: int, req: dict[str, Any]) -> dict[str, Any]:
        lengths = req["lengths"]
        if not isinstance(lengths, list) or not 0 < len(lengths) <= MAX_KEYS:
            raise ValueError("lengths")
        slots = []
        for n in lengths:
            if not isinstance(n, int) or not 0 < n <= self.max_block_bytes:
                raise ValueError("length")
            slot = self.store.alloc_slot(n)
            if slot is None:
                return {"ok": False, "error": "full"}  # the slots taken so far go with `slots`
            slots.append(slot)
        offsets = [self.arena.offset(s) for s in slots]
        tracing.annotate({"ctxcache.kv.slots": len(slots), "ctxcache.kv.bytes_shm": sum(lengths)})
        return {"ok": True, "lease": self._new_lease(cid, slots, lengths), "offsets": offsets}

    def _commit(self, cid: int, req: dict[str, Any]) -> dict[str, Any]:
        metas = req["blocks"]
        lease = self._take(cid, req["lease"])
        if lease is None:
            return {"ok": False, "error": "lease expired", "stored": 0}
        if not isinstance(metas, list) or len(metas) != len(lease.slots):
            raise ValueError("blocks")
        stored = 0
        for slot, n, m in zip(lease.slots, lease.lengths, metas, strict=True):
            if m is None:
                continue
            shape = tuple(int(x) for x in m["shape"])
            if len(shape) != 4:
                raise ValueError("shape")
            key = str(m["key"])
            if len(key.encode()) > MAX_KEY_LENGTH:
                raise ValueError("key")
            meta = BlockMeta(key, n, int(m["fmt"]), int(m["dtype"]), shape)  # type: ignore[arg-type]
            if self.store.put(meta, slot):
                stored += 1
                self.metrics.local_bytes.labels("store").inc(n)
        tracing.annotate({"ctxcache.kv.stored_blocks": stored})
        return {"ok": True, "stored": stored}

    def _exists(self, cid: int, req: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "found": [self.store.exists(k) for k in _strings(req["keys"])]}


def check_free(directory: Path) -> None:
    """Raise LocalDirInUse when a live sidecar answers on `directory`'s socket."""
    path = directory / SOCKET_NAME
    if not path.exists():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return  # a socket file left by a sidecar that died
    finally:
        probe.close()
    raise LocalDirInUse(f"another sidecar serves {path}; give each sidecar its own --local-dir")


def _strings(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_KEYS:
        raise ValueError("keys")
    if not all(isinstance(k, str) for k in value):
        raise TypeError("keys")
    return value
