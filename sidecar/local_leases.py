"""The local server's lease table (`LeaseTable`): every lease it handed out and every engine
client it knows, under one lock, and what the lease requests do to them — `lease`,
`release` (alone or as a request's `release` list), `alloc`, `commit`, `abort` — and the
periodic sweep of what timed out or whose writer is gone (`expire`).

`sidecar.local.LocalServer` keeps the socket, its connections and the dispatch of requests
to this table; the records here (`LeaseRecord`, `ClientRecord`) are the server's, never
sent. The rules kept here are docs/sidecar.md's "Invariants of the local path" (1, 2, 3):

**A write slot is never handed to anyone else while its writer can write to it.** A write
lease's slots are freed (`Arena.unclaim`, the region's write table) only when its writer
says it is done — a `commit` or an `abort` the table could read, stored or not, in time or
not — or when its writer is provably gone (`_gone`: its lock file let go by the kernel,
or removed by the client's own clean `close`; for a client that could not make one,
silence for `silent_writer_s`). A timeout only stops the commit from storing anything
(`expire`).

**A refusal keeps the lease.** A `commit` or `abort` refused as a bad request — one that
cannot be read (not JSON, no lease id), or whose contents are out of bounds (a key over
150 bytes, a header field out of range, more or fewer blocks than slots) — changes nothing:
the lease stays open, its writer's to end with another commit or an abort, or to lose when
the writer is gone. (Only that rule covers every refusal: one that cannot be read names no
lease to release.) `LocalClient.commit` aborts a lease whose commit was so refused, at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ctxcache import tracing
from sidecar.arena import Arena, round_up
from sidecar.arena_clients import client_alive, client_lock_path
from sidecar.blocks import BlockMeta
from sidecar.local_protocol import (
    MAX_KEYS,
    MAX_LEASES,
    Placed,
    checked_meta,
    client_number,
    lease_answer,
    strings,
)
from sidecar.metrics import SidecarMetrics
from sidecar.store import BlockStore

log = logging.getLogger("sidecar.local")  # (the local path logs as one)

CLIENT_SHARE = 0.5  # of the region, allocated to one client's writes at most
ANONYMOUS = "conn-"  # the token of a connection that said no hello: "conn-<its number>"


@dataclass
class ClientRecord:
    """The table's record of an engine's client, across its connections."""

    token: str
    lock: bool = False  # holds client-<token>.lock: its death (or close) is seen at once
    conns: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    write_bytes: int = 0  # allocated to its write leases, ended ones included


@dataclass
class LeaseRecord:
    """The table's record of one lease (the client's view of it: `sidecar.local_region`)."""

    client: str
    write: bool
    expires: float
    slots: list[Any] = field(default_factory=list)  # references that keep the slots
    lengths: list[int] = field(default_factory=list)  # (write) the requested lengths
    nbytes: int = 0  # (write) the slots' aligned sizes, counted against the client's share
    ended: bool = False  # (write) past its timeout: its commit stores nothing
    conn: int = 0  # (read) the connection it was granted on: closed if it times out


class LeaseTable:
    """The leases and clients of one local server, and the requests that change them.

    `hang_up(conn)` closes a connection of the server's: called, under the table's lock,
    for the connection a read lease was granted on before that lease's slots can go
    (`expire`); it must not call back into the table."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        metrics: SidecarMetrics,
        *,
        lease_timeout_s: float,
        max_block_bytes: int,
        silent_writer_s: float,
        hang_up: Callable[[int], None],
    ) -> None:
        self.store, self.arena, self.metrics = store, arena, metrics
        self.lease_timeout_s = lease_timeout_s
        self.max_block_bytes = max_block_bytes
        # how long an ended write of a client without a lock file is kept after it was
        # last heard from (it may still be writing: nothing else says it is not)
        self.silent_writer_s = silent_writer_s
        self.released_batched = 0  # read leases released by a `release` list on a request
        self._hang_up = hang_up
        self._started = time.monotonic()
        self._leases: dict[int, LeaseRecord] = {}
        self._clients: dict[str, ClientRecord] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    # ---- clients ----------------------------------------------------------------------
    def hello(self, old: str, token: str, *, lock: bool) -> None:
        """A connection that was `old`'s is now client `token`'s (`lock`: it holds its
        lock file)."""
        with self._lock:
            if old != token:
                prev = self._clients.get(old)
                if prev is not None:
                    prev.conns -= 1
                client = self._clients.setdefault(token, ClientRecord(token))
                client.conns += 1
            client = self._clients[token]
            client.lock = lock
            client.last_seen = time.monotonic()

    def seen(self, token: str) -> None:
        """`token` sent a request."""
        with self._lock:
            client = self._clients.get(token)
            if client is not None:
                client.last_seen = time.monotonic()

    def disconnected(self, token: str) -> None:
        """A connection of `token`'s closed: an anonymous one takes its leases with it; a
        client's leases stay, unless it is gone."""
        if token.startswith(ANONYMOUS):
            self._drop_client(token, "disconnect")  # (no hello: this was all of it)
            return
        with self._lock:
            client = self._clients.get(token)
            if client is None:
                return
            client.conns -= 1
            quiet = client.conns == 0
        if quiet and self._gone(client, time.monotonic()):
            self._drop_client(token, "disconnect")

    def _gone(self, client: ClientRecord, now: float) -> bool:
        """Whether nothing of `client` can still write into the region. A client that said
        hello holding its lock file: that file let go (the process ended, `client_alive`)
        or no longer there (its clean `close` removes it; a file there that we cannot open
        says nothing). Without a lock file: silence for `silent_writer_s`."""
        if client.lock:
            alive = client_alive(self.arena.directory, client.token)
            if alive is None:  # absent, or not ours to open
                return not os.path.lexists(client_lock_path(self.arena.directory, client.token))
            return not alive
        return now - client.last_seen > self.silent_writer_s

    def _drop_client(self, token: str, why: str) -> None:
        """A client that is gone: every lease it held ends, every slot is free again."""
        with self._lock:
            gone = [i for i, lease in self._leases.items() if lease.client == token]
            for i in gone:
                del self._leases[i]
            self._clients.pop(token, None)
        for i in gone:
            self.arena.unclaim(i)
        if gone:
            self.metrics.leases_expired.labels(why).inc(len(gone))

    # ---- the sweep --------------------------------------------------------------------
    def expire(self, now: float) -> int:
        """End the leases past their timeout (a write lease's slots stay its writer's),
        free what gone clients held, and the earlier generation's writes whose writers are
        gone. Returns how many leases timed out."""
        with self._lock:
            timed_out = [
                i for i, lease in self._leases.items() if lease.expires <= now and not lease.ended
            ]
            for i in timed_out:
                lease = self._leases[i]
                if lease.write:
                    lease.ended = True  # quarantined: freed by its writer or its death
                    continue
                # the connection it was granted on is closed *before* its slots can go:
                # a client that trusts a copy without a release round trip checks that
                # this connection is still open after its copies (`LocalClient.release`)
                self._hang_up(lease.conn)
                del self._leases[i]
            quiet = [c for c in self._clients.values() if c.conns == 0]
        if timed_out:
            self.metrics.leases_expired.labels("timeout").inc(len(timed_out))
            log.warning(
                "%d leases timed out; their holders' copies count as misses", len(timed_out)
            )
        for client in quiet:  # (clients that said hello; anonymous ones end with their connection)
            if self._gone(client, now):
                self._drop_client(client.token, "disconnect")
        for lease_id, (client_id, _) in list(self.arena.inherited.items()):
            alive = client_alive(self.arena.directory, f"{client_id:016x}")
            silent = now - self._started > self.silent_writer_s
            if alive is False or (alive is None and silent):
                with self._lock:
                    self._leases.pop(lease_id, None)
                self.arena.end_inherited(lease_id)
        return len(timed_out)

    # ---- the lease requests: (connection, client token, request) -> answer ------------
    def _new_lease(self, lease: LeaseRecord) -> int | None:
        """Register `lease`; None when its client holds too many already."""
        with self._lock:
            held = sum(1 for x in self._leases.values() if x.client == lease.client)
            if held >= MAX_LEASES:
                return None
            lease_id = secrets.randbits(63) or 1
            while lease_id in self._leases or lease_id in self.arena.inherited:
                lease_id = secrets.randbits(63) or 1
            self._leases[lease_id] = lease
        return lease_id

    def _take(self, token: str, lease_id: object, *, write: bool) -> LeaseRecord | None:
        """Remove and return `token`'s lease `lease_id` of that kind (None: no such)."""
        if not isinstance(lease_id, int) or isinstance(lease_id, bool):
            return None
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.client != token or lease.write != write:
                return None
            del self._leases[lease_id]
            if write:
                client = self._clients.get(token)
                if client is not None:
                    client.write_bytes -= lease.nbytes
        return lease

    def _slots_of(self, token: str, lease_id: object) -> int | None:
        """How many slots `token`'s write lease `lease_id` has (None: no such lease)."""
        if not isinstance(lease_id, int) or isinstance(lease_id, bool):
            return None
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.client != token or not lease.write:
                return None
            return len(lease.slots)

    def _current(self, req: dict[str, Any]) -> bool:
        """Whether the request is of this sidecar's generation (or does not say)."""
        gen = req.get("generation")
        return gen is None or gen == self.arena.generation

    def lease(self, cid: int, token: str, req: dict[str, Any]) -> dict[str, Any]:
        keys = strings(req["keys"])
        slots: list[Any] = []  # what the lease holds
        placed: list[Placed] = []  # per key: the block and its offset, False (tcp) or None
        leased = 0
        for found in self.store.lease_many(keys):
            if found:
                meta, slot, offset = found  # type: ignore[misc]
                slots.append(slot)
                leased += meta.length
                found = (meta, offset)
            placed.append(found)  # type: ignore[arg-type]
        lease_id = 0
        if slots:
            expires = time.monotonic() + self.lease_timeout_s
            got = self._new_lease(LeaseRecord(token, False, expires, slots, conn=cid))
            if got is None:
                return {"ok": False, "error": f"too many leases (at most {MAX_LEASES})"}
            lease_id = got
        self.metrics.local_bytes.labels("load").inc(leased)
        tracing.annotate(
            {
                "ctxcache.kv.keys": len(keys),
                "ctxcache.kv.blocks_shm": len(slots),
                "ctxcache.kv.blocks_tcp": placed.count(False),
                "ctxcache.kv.bytes_shm": leased,
            }
        )
        answer = lease_answer(placed, columns=req.get("columns") is True)
        return {"ok": True, "lease": lease_id, **answer}

    def release(self, cid: int, token: str, req: dict[str, Any]) -> dict[str, Any]:
        held = self._release_one(token, req)
        tracing.annotate({"ctxcache.kv.lease_held": held})
        return {"ok": held}

    def _release_one(self, token: str, req: dict[str, Any]) -> bool:
        """End `token`'s read lease `req["lease"]`; whether it held until now."""
        lease = self._take(token, req["lease"], write=False) if self._current(req) else None
        return lease is not None and lease.expires > time.monotonic()

    def release_batch(self, token: str, batch: list[dict[str, Any]]) -> int:
        """The read leases a request carried in `release`: each released as its own
        `release` would be (a span each, joined to the trace it names); how many held."""
        held = 0
        for entry in batch:
            trace = entry.get("trace")
            if tracing.enabled() and isinstance(trace, dict):
                carrier = {str(k): str(v) for k, v in trace.items()}
                with tracing.span_in(carrier, "sidecar local release", server=True):
                    ok = self._release_one(token, entry)
                    tracing.annotate({"ctxcache.kv.lease_held": ok, "ctxcache.kv.batched": True})
            else:
                ok = self._release_one(token, entry)
            held += ok
        self.released_batched += len(batch)
        return held

    def alloc(self, cid: int, token: str, req: dict[str, Any]) -> dict[str, Any]:
        lengths = req["lengths"]
        if not isinstance(lengths, list) or not 0 < len(lengths) <= MAX_KEYS:
            raise ValueError("lengths")
        for n in lengths:
            if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= self.max_block_bytes:
                raise ValueError("length")
        if token.startswith(ANONYMOUS):  # a writer must be one we can tell is alive
            return {"ok": False, "error": "say hello with a client token first"}
        need = sum(round_up(n, 4096) for n in lengths)
        share = int(self.arena.capacity * CLIENT_SHARE)
        with self._lock:
            client = self._clients.get(token)
            mine = client.write_bytes if client is not None else 0
        if mine + need > share:
            self.metrics.region_full.inc()
            return {"ok": False, "error": "full", "reason": "over one engine's share"}
        if need > self.arena.free_bytes() + self.store.mem_region:
            self.metrics.region_full.inc()  # evicting everything would not make it fit
            return {"ok": False, "error": "full", "reason": "larger than the region can free"}
        slots = []
        for n in lengths:
            slot = self.store.alloc_slot(n)
            if slot is None:
                return {"ok": False, "error": "full"}  # the slots taken so far go with `slots`
            slots.append(slot)
        expires = time.monotonic() + self.lease_timeout_s
        lease_id = self._new_lease(LeaseRecord(token, True, expires, slots, lengths, need))
        if lease_id is None:
            return {"ok": False, "error": f"too many leases (at most {MAX_LEASES})"}
        if not self.arena.claim(lease_id, client_number(token), slots):
            with self._lock:
                del self._leases[lease_id]
            return {"ok": False, "error": "full", "reason": "too many slots in flight"}
        with self._lock:
            if token in self._clients:
                self._clients[token].write_bytes += need
        offsets = [self.arena.offset(s) for s in slots]
        tracing.annotate({"ctxcache.kv.slots": len(slots), "ctxcache.kv.bytes_shm": sum(lengths)})
        return {"ok": True, "lease": lease_id, "offsets": offsets}

    def commit(self, cid: int, token: str, req: dict[str, Any]) -> dict[str, Any]:
        """Store a write lease's slots as blocks. A commit that is read ends its lease's
        write, stored or not; one refused as a bad request (raised, or answered `bad
        request`) leaves the lease as it was (the module's rule)."""
        metas = req["blocks"]
        if not isinstance(metas, list):
            raise ValueError("blocks")
        checked = [None if m is None else checked_meta(m) for m in metas]
        lease_id = req["lease"]
        if not self._current(req):  # a writer of an earlier generation is done
            self._end_inherited(token, lease_id)
            return {"ok": False, "error": "stale generation", "stored": 0}
        if self._slots_of(token, lease_id) not in (None, len(checked)):
            return {"ok": False, "error": "bad request: blocks", "stored": 0}
        lease = self._take(token, lease_id, write=True)
        if lease is None:
            self._end_inherited(token, lease_id)
            return {"ok": False, "error": "no such lease", "stored": 0}
        self.arena.unclaim(lease_id)  # the writer is done, stored or not
        if lease.ended or lease.expires <= time.monotonic():
            return {"ok": False, "error": "lease expired", "stored": 0}
        stored = 0
        for slot, n, m in zip(lease.slots, lease.lengths, checked, strict=True):
            if m is None:
                continue
            key, fmt, dtype, shape = m
            if self.store.put(BlockMeta(key, n, fmt, dtype, shape), slot):
                stored += 1
                self.metrics.local_bytes.labels("store").inc(n)
        tracing.annotate({"ctxcache.kv.stored_blocks": stored})
        return {"ok": True, "stored": stored}

    def abort(self, cid: int, token: str, req: dict[str, Any]) -> dict[str, Any]:
        lease = self._take(token, req["lease"], write=True) if self._current(req) else None
        if lease is None:
            return {"ok": self._end_inherited(token, req["lease"])}
        self.arena.unclaim(req["lease"])
        return {"ok": True}

    def _end_inherited(self, token: str, lease_id: object) -> bool:
        """An earlier generation's writer says it is done with `lease_id`."""
        held = self.arena.inherited.get(lease_id) if isinstance(lease_id, int) else None
        if held is None or f"{held[0]:016x}" != token:
            return False
        return self.arena.end_inherited(lease_id)  # type: ignore[arg-type]
