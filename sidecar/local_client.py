"""An engine's end of the local data path (`sidecar.local`): the region mapped once, the
socket for which blocks, where, and leases.

`LocalClient` offers two levels:
- **leases** (`lease`/`release`, `alloc`/`commit`): the caller copies straight between
  the region and its KV cache (the vLLM connector does, `vllm_connector.worker`);
- the **`BlockClient` calls** of the TCP client (`get_many`, `put`, `exists_many`...), each
  one copy through the region, so the built-in worker's storer and loader use it unchanged.

Anything the local path cannot do goes to the sidecar's `lm://` port instead (`fallback`):
a block that is there but got no slot, a store when the region is full. A lease that
ended before its release (timeout, the sidecar restarted, the connection dropped) makes
`release` answer False: the caller throws its copies away, a miss. A new sidecar
generation (a restart) is noticed at the next connection and the new region is mapped.

Every lease names the region it is in (`ReadLease.region`, `WriteLease.region`), captured
with the sidecar's reply under the same lock, and its generation travels with its release,
commit and abort: a lease of an older sidecar can never be vouched for by a newer one. A
write lease must end in `commit` or `abort` once the caller has stopped writing, even when
something failed: until then the sidecar hands its slots to nobody else (docs/sidecar.md,
"Invariants of the local path", 2). Leases are the client's, not the connection's. The
client holds `client-<token>.lock` in the directory until its `close`, so the sidecar sees
at once when the process is gone. Thread-safe: one round trip at a time.

**Releases off the critical path** (`defer_releases=True`, the vLLM connector): a read lease
still valid beyond doubt (`sidecar.local_deferred.still_valid`) is trusted without waiting
for its release's answer, and its release queued (`ReleaseQueue`, which sends through
`_send_releases`). `Region`, `ReadLease` and `WriteLease` are `sidecar.local_region`'s;
`LocalError`, `Slot` and `TCP` `sidecar.local_protocol`'s (all importable from here).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ctxcache import tracing
from sidecar.arena_clients import drop_client_lock, take_client_lock
from sidecar.arena_dir import SOCKET_NAME
from sidecar.client import KVBlock
from sidecar.local_deferred import FLUSH_AFTER_S, ReleaseQueue, still_valid
from sidecar.local_protocol import (
    TCP,
    LocalError,
    Slot,
    decode,
    encode,
    lease_blocks,
    open_socket,
)
from sidecar.local_region import ReadLease, Region, WriteLease
from sidecar.protocol import Shape

log = logging.getLogger(__name__)


class LocalClient:
    def __init__(
        self,
        directory: str | Path,
        *,
        timeout: float = 5.0,
        fallback: Callable[[], Any] | None = None,
        defer_releases: bool = False,
        flush_after_s: float = FLUSH_AFTER_S,
    ) -> None:
        self.directory = Path(directory)
        self.timeout = timeout
        self.defer_releases = defer_releases  # trust valid leases, release them later
        self._make_fallback = fallback
        self._fallback: Any = None
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self._lock = threading.RLock()
        self.token = secrets.token_hex(8)  # this client, across its connections
        self._lock_fd = -1  # client-<token>.lock, held while we live (taken at connect)
        self._unsettled: list[WriteLease] = []  # done writing, the sidecar not yet told
        self._kept = False  # a write lease may be written until this process ends
        self.region: Region | None = None
        self.on_map: list[Callable[[Region], None]] = []  # told when a region is (re)mapped
        self._conn = 0  # connections opened so far: names the open one
        self._lease_timeout: float | None = None  # the sidecar's, from its hello
        self._batch_ok = False  # the sidecar takes a `release` list on any request
        # read leases trusted and not yet released (sent with the next request, or flushed)
        self._releases = ReleaseQueue(self._send_releases, flush_after_s)

    @property
    def trusted_releases(self) -> int:
        """Releases that did not wait for their answer."""
        return self._releases.queued

    @property
    def flush_after_s(self) -> float:
        """A queued release goes on its own after this long without a request."""
        return self._releases.flush_after_s

    @flush_after_s.setter
    def flush_after_s(self, value: float) -> None:
        self._releases.flush_after_s = value

    @staticmethod
    def available(directory: str | Path) -> bool:
        return (Path(directory) / SOCKET_NAME).exists()

    # ---- leases: the caller copies --------------------------------------------------
    def lease(self, keys: Sequence[str]) -> ReadLease:
        """Lease every key that is present (one round trip); read the slots in
        `lease.region`."""
        with self._lock:
            sent = time.monotonic()
            req = {"op": "lease", "keys": list(keys), "columns": True}
            reply, region = self._call_in(req, retry=True)
            conn = self._conn
        return ReadLease(reply["lease"], region.generation, lease_blocks(reply), region, sent, conn)

    def release(self, lease: ReadLease, *, defer: bool = True) -> bool:
        """End the lease once no copy reads its slots any more; True only if it held until
        now (the copies made under it are the blocks). With `defer_releases` (and `defer`)
        a lease that is still valid beyond doubt (`still_valid`) is vouched for at once and its
        release queued (sent with the next request, or flushed); otherwise the answer is
        waited for. Never raises: an unreachable sidecar means the lease is gone."""
        if not lease.id:
            return True  # nothing was leased
        req = {"op": "release", "lease": lease.id, "generation": lease.generation}
        if defer and self.defer_releases:
            with self._lock:
                valid = still_valid(
                    lease,
                    sock=self._sock,
                    conn=self._conn,
                    region=self.region,
                    lease_timeout_s=self._lease_timeout,
                )
                if valid:
                    self._releases.put(lease.id, lease.generation)
                    return True
        try:
            with self._lock:
                if self.region is None or self.region.generation != lease.generation:
                    return False  # that sidecar is gone, and its leases with it
                return bool(self._call(req, retry=True, check=False).get("ok"))
        except LocalError:
            return False

    def alloc(self, lengths: Sequence[int]) -> WriteLease | None:
        """Slots to write blocks into (one round trip), or None when the region is full or
        this client's share of it is taken. End the lease with `commit` or `abort`."""
        self._settle()
        req = {"op": "alloc", "lengths": list(lengths)}
        reply, region = self._call_in(req, retry=True, check=False)
        if not reply.get("ok"):
            if reply.get("error") == "full":
                return None
            raise LocalError(f"alloc refused: {reply.get('error')}")
        slots = [Slot(o, n) for o, n in zip(reply["offsets"], lengths, strict=True)]
        return WriteLease(reply["lease"], region.generation, slots, region)

    def commit(
        self, lease: WriteLease, blocks: Sequence[tuple[str, int, int, Shape] | None]
    ) -> int:
        """Store the allocated slots as blocks `(key, fmt, dtype, shape)` (None: give the slot
        up); returns how many were stored. 0 if the lease ended first (the sidecar then
        has the slots back) or the sidecar refused the commit as a bad request (a key over
        150 bytes, a field out of range): a refusal leaves the lease open, so it is aborted
        here. Raises LocalError when the sidecar cannot be reached."""
        metas = [
            None if b is None else {"key": b[0], "fmt": b[1], "dtype": b[2], "shape": list(b[3])}
            for b in blocks
        ]
        req = {"op": "commit", "lease": lease.id, "generation": lease.generation, "blocks": metas}
        try:
            reply = self._call(req, retry=True, check=False)
        except LocalError:
            self._unsettled.append(lease)  # told again (an abort) at the next alloc
            raise
        if not reply.get("ok"):
            error = str(reply.get("error"))
            log.warning("local store of %d blocks not taken: %s", len(metas), error)
            if error.startswith("bad request"):  # refused: the lease is still open
                self.abort(lease)
        return int(reply.get("stored", 0))

    def abort(self, lease: WriteLease) -> None:
        """Done writing, nothing to store: the slots go back. Never raises: a sidecar that
        cannot be reached is told at the next `alloc` (or sees this process end)."""
        req = {"op": "abort", "lease": lease.id, "generation": lease.generation}
        try:
            self._call(req, retry=True, check=False)
        except LocalError:
            self._unsettled.append(lease)

    def keep_until_exit(self, lease: WriteLease) -> None:
        """The caller cannot tell whether something still writes into `lease`'s slots (a
        copy on a broken CUDA context): they stay this process's until it ends. `close`
        then leaves the lock file held, so the sidecar frees them only when the kernel
        lets go of it."""
        with self._lock:
            self._kept = True
        log.error("a write lease may still be written: its slots are kept until this exits")

    def _settle(self) -> None:
        """Tell the sidecar (this one or the next: the region's write table carries them)
        about write leases we are done with but could not say so at the time."""
        with self._lock:
            pending, self._unsettled = self._unsettled, []
        for lease in pending:
            self.abort(lease)

    # ---- the BlockClient calls (one copy through the region) ------------------------
    def get_many(self, keys: Sequence[str]) -> list[KVBlock | None]:
        with self._lock:
            lease = self.lease(keys)
            out: list[KVBlock | None] = []
            tcp: list[int] = []
            for i, b in enumerate(lease.blocks):
                if isinstance(b, Slot):
                    assert lease.region is not None
                    view = lease.region.view[b.offset : b.offset + b.length]
                    out.append(KVBlock(bytearray(view), b.fmt, b.dtype, b.shape))
                else:
                    out.append(None)
                    if b == TCP:
                        tcp.append(i)
            if not self.release(lease):
                return [None] * len(keys)  # the copies raced something: a miss
        if tcp and self._make_fallback is not None:
            got = self.fallback().get_many([keys[i] for i in tcp])
            for i, block in zip(tcp, got, strict=True):
                out[i] = block
        return out

    def get(self, key: str) -> KVBlock | None:
        return self.get_many([key])[0]

    def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        fmt: int,
        dtype: int,
        shape: Shape,
    ) -> None:
        payload = memoryview(data).cast("B")
        with self._lock:
            lease = self.alloc([len(payload)])
            if lease is not None:
                try:
                    lease.view(lease.slots[0])[:] = payload
                except BaseException:
                    self.abort(lease)
                    raise
                if self.commit(lease, [(key, fmt, dtype, shape)]) == 1:
                    return
        if self._make_fallback is None:
            raise LocalError("the shared region is full or did not take the block")
        self.fallback().put(key, payload, fmt=fmt, dtype=dtype, shape=shape)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        reply = self._call({"op": "exists", "keys": list(keys)}, retry=True)
        return [bool(x) for x in reply["found"]]

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def health(self) -> bool:
        try:
            self._call({"op": "hello"}, retry=True)
        except LocalError:
            return False
        return True

    def fallback(self) -> Any:
        if self._fallback is None:
            assert self._make_fallback is not None
            self._fallback = self._make_fallback()
        return self._fallback

    def flush(self) -> None:
        """Send the queued releases now (one round trip). Never raises: a sidecar that is
        gone took its leases with it."""
        self._releases.flush()

    def _send_releases(self, pending: list[dict[str, Any]]) -> None:
        """(The release queue's.) Send queued releases: one `release` carrying the rest as
        its list, or one each to a sidecar that takes no list. Never raises."""
        with self._lock:
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

    def close(self) -> None:
        """Queued releases sent, then the lock file removed before the connection closes:
        the sidecar takes a client whose lock file is gone for gone, and frees every lease
        it still holds, write leases too (docs/sidecar.md, invariant 2). So close only
        once nothing writes into a write lease of this client any more, or after
        `keep_until_exit`."""
        with self._lock:
            if self._sock is not None:  # (not connected: its leases end with our lock)
                self.flush()
        self._releases.close(self.timeout)
        with self._lock:
            if not self._kept:  # (kept: held, open, until the process ends)
                drop_client_lock(self.directory, self.token, self._lock_fd)
                self._lock_fd = -1
            self._disconnect()
            if self.region is not None:
                self.region.close()
                self.region = None
            if self._fallback is not None:
                self._fallback.close()
                self._fallback = None

    # ---- plumbing -------------------------------------------------------------------
    def connect(self) -> Region:
        """Connect (if not connected) and map the sidecar's current region."""
        with self._lock:
            if self._sock is None:
                try:
                    sock = open_socket(self.directory / SOCKET_NAME, self.timeout)
                except OSError as exc:
                    raise LocalError(f"local sidecar socket in {self.directory}: {exc}") from exc
                self._sock, self._reader = sock, sock.makefile("rb")
                self._conn += 1
                if self._lock_fd < 0:
                    self._lock_fd = take_client_lock(self.directory, self.token)
                hello_req = {"op": "hello", "client": self.token, "lock": self._lock_fd >= 0}
                try:
                    hello = self._exchange(hello_req)
                    self._map(hello)
                    limit = hello.get("lease_timeout_s")
                    self._lease_timeout = float(limit) if limit is not None else None
                    self._batch_ok = hello.get("release_batch") is True
                except (OSError, KeyError, ValueError) as exc:
                    self._disconnect()
                    raise LocalError(f"local sidecar handshake failed: {exc}") from exc
            assert self.region is not None
            return self.region

    def _map(self, hello: dict[str, Any]) -> None:
        generation = str(hello["generation"])
        if self.region is not None and self.region.generation == generation:
            return
        region = Region(Path(hello["region"]), int(hello["size"]), generation)
        old, self.region = self.region, region
        if old is not None:
            # the old mapping goes when the last lease over it does (never under a copy)
            log.info("the sidecar restarted (generation %s); mapped its new region", generation)
        for listener in self.on_map:
            listener(region)

    def _call(
        self, req: dict[str, Any], *, retry: bool = False, check: bool = True
    ) -> dict[str, Any]:
        return self._call_in(req, retry=retry, check=check)[0]

    def _call_in(
        self, req: dict[str, Any], *, retry: bool = False, check: bool = True
    ) -> tuple[dict[str, Any], Region]:
        """One round trip; the reply and the region it speaks of (read under the lock
        that made the trip: a reconnect on another thread cannot come in between)."""
        if req["op"] != "hello" and "trace" not in req and (trace := tracing.carrier()):
            req = {**req, "trace": trace}  # the sidecar's span joins the caller's trace
        with self._lock:
            if self._batch_ok and req["op"] != "hello" and (queued := self._releases.take()):
                # queued releases ride along, released by the sidecar before `req`
                req = {**req, "release": [*req.get("release", ()), *queued]}
            for attempt in (1, 2):
                try:
                    region = self.connect()
                    reply = self._exchange(req)
                    break
                except (OSError, ValueError) as exc:
                    self._disconnect()
                    if attempt == 2 or not retry:
                        raise LocalError(f"local sidecar: {exc}") from exc
        if check and not reply.get("ok"):
            raise LocalError(f"local sidecar refused {req['op']}: {reply.get('error')}")
        return reply, region

    def _exchange(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self._sock is not None
        self._sock.sendall(encode(req))
        line = self._reader.readline()
        if not line:
            raise ConnectionResetError("the sidecar closed the local connection")
        return decode(line)

    def _disconnect(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(OSError):
                self._reader.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None
