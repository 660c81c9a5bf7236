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

Every lease names the region it is in (`Lease.region`, `WriteLease.region`), captured with
the sidecar's reply under the same lock, and its generation travels with its release,
commit and abort: a lease of an older sidecar can never be vouched for by a newer one. A
write lease must end in `commit` or `abort` once the caller has stopped writing, even when
something failed: until then the sidecar hands its slots to nobody else (docs/sidecar.md,
"Invariants of the local path"). Leases are the client's, not the connection's: a timeout
that drops the connection on one thread leaves every other thread's leases alone. The
client holds `client-<token>.lock` in the directory for its life, so the sidecar sees at
once when the process is gone. Thread-safe: one round trip at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ctxcache import tracing
from sidecar.arena import (
    MAGIC,
    MAP_FLAGS,
    SOCKET_NAME,
    drop_client_lock,
    read_generation,
    take_client_lock,
)
from sidecar.client import KVBlock
from sidecar.protocol import Shape

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Slot:
    """Where a leased block (or an allocated slot) lies in the region, and its header."""

    offset: int
    length: int
    fmt: int = 0
    dtype: int = 0
    shape: Shape = (0, 0, 0, 0)


TCP = "tcp"  # a lease answer: the block is there, but read it over lm://


@dataclass
class Lease:
    id: int
    generation: str
    blocks: list[Slot | str | None]  # per key: a slot, TCP, or None (a miss)
    region: Region | None = None  # the mapping its slots are in

    def view(self, slot: Slot) -> memoryview:
        assert self.region is not None
        return self.region.view[slot.offset : slot.offset + slot.length]


@dataclass
class WriteLease:
    """Slots to write blocks into; end it with `commit` or `abort`."""

    id: int
    generation: str
    slots: list[Slot]
    region: Region

    def view(self, slot: Slot) -> memoryview:
        return self.region.view[slot.offset : slot.offset + slot.length]


class Region:
    """The sidecar's region, mapped read-write (stores write into it)."""

    def __init__(self, path: Path, size: int, generation: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise OSError(f"{path} is smaller than the sidecar says")
            self.map = mmap.mmap(fd, size, MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if self.map[: len(MAGIC)] != MAGIC or read_generation(path) != generation:
            self.map.close()
            raise OSError(f"{path} is not generation {generation}'s region")
        self.path, self.size, self.generation = path, size, generation
        self.view = memoryview(self.map)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # views still exported: unmapped when they go
            self.view.release()
            self.map.close()


class LocalError(ConnectionError):
    """The local socket is unreachable or answered out of protocol."""


class LocalClient:
    def __init__(
        self,
        directory: str | Path,
        *,
        timeout: float = 5.0,
        fallback: Callable[[], Any] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.timeout = timeout
        self._make_fallback = fallback
        self._fallback: Any = None
        self._sock: socket.socket | None = None
        self._reader: Any = None
        self._lock = threading.RLock()
        self.token = secrets.token_hex(8)  # this client, across its connections
        self._lock_fd = -1  # client-<token>.lock, held while we live (taken at connect)
        self._unsettled: list[WriteLease] = []  # done writing, the sidecar not yet told
        self.region: Region | None = None
        self.on_map: list[Callable[[Region], None]] = []  # told when a region is (re)mapped

    @staticmethod
    def available(directory: str | Path) -> bool:
        return (Path(directory) / SOCKET_NAME).exists()

    # ---- leases: the caller copies --------------------------------------------------
    def lease(self, keys: Sequence[str]) -> Lease:
        """Lease every key that is present (one round trip); read the slots in
        `lease.region`."""
        reply, region = self._call_in({"op": "lease", "keys": list(keys)}, retry=True)
        blocks: list[Slot | str | None] = []
        for b in reply["blocks"]:
            if isinstance(b, dict):
                blocks.append(
                    Slot(b["offset"], b["length"], b["fmt"], b["dtype"], tuple(b["shape"]))  # type: ignore[arg-type]
                )
            else:
                blocks.append(TCP if b == TCP else None)
        return Lease(reply["lease"], region.generation, blocks, region)

    def release(self, lease: Lease) -> bool:
        """End the lease; True only if it held until now (the copies made under it are the
        blocks). Never raises: an unreachable sidecar means the lease is gone."""
        if not lease.id:
            return True  # nothing was leased
        req = {"op": "release", "lease": lease.id, "generation": lease.generation}
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
        up); returns how many were stored (0 if the lease ended first: the sidecar then
        has the slots back). Raises LocalError when the sidecar cannot be reached."""
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
            log.warning("local store of %d blocks not taken: %s", len(metas), reply.get("error"))
        return int(reply.get("stored", 0))

    def abort(self, lease: WriteLease) -> None:
        """Done writing, nothing to store: the slots go back. Never raises: a sidecar that
        cannot be reached is told at the next `alloc` (or sees this process end)."""
        req = {"op": "abort", "lease": lease.id, "generation": lease.generation}
        try:
            self._call(req, retry=True, check=False)
        except LocalError:
            self._unsettled.append(lease)

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

    def close(self) -> None:
        with self._lock:
            self._disconnect()
            if self.region is not None:
                self.region.close()
                self.region = None
            drop_client_lock(self.directory, self.token, self._lock_fd)
            self._lock_fd = -1
            if self._fallback is not None:
                self._fallback.close()
                self._fallback = None

    # ---- plumbing -------------------------------------------------------------------
    def connect(self) -> Region:
        """Connect (if not connected) and map the sidecar's current region."""
        with self._lock:
            if self._sock is None:
                try:
                    sock = self._open_socket()
                except OSError as exc:
                    raise LocalError(f"local sidecar socket in {self.directory}: {exc}") from exc
                self._sock, self._reader = sock, sock.makefile("rb")
                if self._lock_fd < 0:
                    self._lock_fd = take_client_lock(self.directory, self.token)
                hello_req = {"op": "hello", "client": self.token, "lock": self._lock_fd >= 0}
                try:
                    hello = self._exchange(hello_req)
                    self._map(hello)
                except (OSError, KeyError, ValueError) as exc:
                    self._disconnect()
                    raise LocalError(f"local sidecar handshake failed: {exc}") from exc
            assert self.region is not None
            return self.region

    def _open_socket(self) -> socket.socket:
        """A connection to the sidecar's socket. A full accept queue (a burst of
        connections) answers EAGAIN on a Unix socket at once: tried again until the
        timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.directory / SOCKET_NAME))
                return sock
            except BlockingIOError:
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
            except OSError:
                sock.close()
                raise

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
        if req["op"] != "hello" and (trace := tracing.carrier()):
            req = {**req, "trace": trace}  # the sidecar's span joins the caller's trace
        with self._lock:
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
        self._sock.sendall(json.dumps(req, separators=(",", ":")).encode() + b"\n")
        line = self._reader.readline()
        if not line:
            raise ConnectionResetError("the sidecar closed the local connection")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError("reply is not an object")
        return reply

    def _disconnect(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(OSError):
                self._reader.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None
