"""The worker's side of the KV sidecar: lookups on the engine thread, stores in the background.

The sidecar is an optimisation, never a dependency: any error, timeout or block that is not
exactly what we wrote is a miss, and the request recomputes. After a connection failure a
circuit breaker skips the sidecar for a while (1 s, doubling to 30 s) instead of paying a
timeout on every request.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.kv.layout import KVShape

log = logging.getLogger(__name__)


class BlockClient(Protocol):
    """What we use of `sidecar.client.KVClient` (one per thread)."""

    def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        fmt: int,
        dtype: int,
        shape: tuple[int, int, int, int],
    ) -> None: ...
    def get(self, key: str) -> object | None: ...
    def get_many(self, keys: Sequence[str]) -> list[object | None]: ...
    def exists(self, key: str) -> bool: ...
    def exists_many(self, keys: Sequence[str]) -> list[bool]: ...
    def health(self) -> bool: ...
    def close(self) -> None: ...


ClientFactory = Callable[[], BlockClient]


def kv_client_factory(url: str, timeout: float, local_dir: str | None = None) -> ClientFactory:
    """Clients of the sidecar at `url`; through its shared region (`sidecar.local_client`)
    when `local_dir` holds its local socket, with `url` for what the region cannot serve."""

    def make_tcp() -> BlockClient:
        from sidecar.client import KVClient

        return KVClient.from_url(url, timeout=timeout)

    def make() -> BlockClient:
        if local_dir is not None:
            from sidecar.local_client import LocalClient

            if LocalClient.available(local_dir):
                return LocalClient(local_dir, timeout=timeout, fallback=make_tcp)
            log.warning("no local sidecar socket in %s; KV goes over %s", local_dir, url)
        return make_tcp()

    return make


def kv_path(local_dir: str | None) -> str:
    """Which path `kv_client_factory(..., local_dir)` takes now: "shm" or "tcp"."""
    if local_dir is None:
        return "tcp"
    from sidecar.local_client import LocalClient

    return "shm" if LocalClient.available(local_dir) else "tcp"


class CircuitBreaker:
    def __init__(self, first: float = 1.0, longest: float = 30.0) -> None:
        self.first, self.longest = first, longest
        self._backoff = 0.0
        self._open_until = 0.0
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return time.monotonic() >= self._open_until

    def success(self) -> None:
        with self._lock:
            self._backoff = 0.0
            self._open_until = 0.0

    def failure(self) -> float:
        with self._lock:
            self._backoff = min(self.longest, max(self.first, self._backoff * 2))
            self._open_until = time.monotonic() + self._backoff
            return self._backoff


@dataclass
class StoreJob:
    """Blocks of one request to PUT: (key, KV `[2, L, H, T, D]`), written in order."""

    blocks: list[tuple[str, torch.Tensor]]
    session: str
    barrier: bool = False  # answer a round trip after the PUTs before it (see drain)

    @property
    def nbytes(self) -> int:
        return sum(kv.numel() * kv.element_size() for _, kv in self.blocks)


class SidecarKV:
    def __init__(
        self,
        make_client: ClientFactory,
        shape: KVShape,
        *,
        max_pending: int = 64,
        max_pending_bytes: int | None = None,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self.shape = shape
        self.breaker = CircuitBreaker()
        self._make_client = make_client
        self._lookup_client: BlockClient | None = None
        self._jobs: queue.Queue[StoreJob | None] = queue.Queue(maxsize=max_pending)
        # bytes of KV queued and not yet sent: a job is refused when it would go over
        # (one job alone is always taken, however large, so nothing is never storable)
        self._max_bytes = max_pending_bytes
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._on_error = on_error or (lambda op: None)
        self._storer = threading.Thread(target=self._store_loop, name="kv-storer", daemon=True)
        self._storer.start()

    # -- lookups (engine thread) --------------------------------------------------------
    def _client(self) -> BlockClient:
        if self._lookup_client is None:
            self._lookup_client = self._make_client()
        return self._lookup_client

    def _failed(self, op: str, exc: Exception) -> None:
        backoff = self.breaker.failure()
        self._on_error(op)
        log.warning(
            "sidecar %s failed (%s: %s); skipping it for %.0f s",
            op,
            type(exc).__name__,
            exc,
            backoff,
        )

    def get(self, key: str, tokens: int) -> torch.Tensor | None:
        """The block under `key` as `[2, L, H, tokens, D]`, or None (miss, error, garbage)."""
        if not self.breaker.closed:
            return None
        try:
            block = self._client().get(key)
        except Exception as exc:
            self._failed("get", exc)
            return None
        self.breaker.success()
        return self._tensor(key, block, tokens)

    def get_many(self, blocks: Sequence[tuple[str, int]]) -> list[torch.Tensor | None]:
        """`get` of every `(key, tokens)` in one round trip (the sidecar answers in order):
        a load of several chunks waits for the sidecar once, not once per chunk."""
        if not self.breaker.closed or not blocks:
            return [None] * len(blocks)
        try:
            got = self._client().get_many([key for key, _ in blocks])
        except Exception as exc:
            self._failed("get", exc)
            return [None] * len(blocks)
        self.breaker.success()
        return [self._tensor(key, b, n) for (key, n), b in zip(blocks, got, strict=True)]

    def _tensor(self, key: str, block: object | None, tokens: int) -> torch.Tensor | None:
        if block is None:
            return None
        kv = self.shape.from_wire(block.data, block.fmt, block.dtype, block.shape, tokens)  # type: ignore[attr-defined]
        if kv is None:
            self._on_error("garbage")
            log.warning(
                "sidecar block %s is not the KV we store (shape %s); recomputing",
                key,
                block.shape,  # type: ignore[attr-defined]
            )
        return kv

    def exists(self, key: str) -> bool:
        if not self.breaker.closed:
            return False
        try:
            found = self._client().exists(key)
        except Exception as exc:
            self._failed("exists", exc)
            return False
        self.breaker.success()
        return bool(found)

    # -- stores (background thread) -----------------------------------------------------
    def submit(self, job: StoreJob) -> bool:
        """Queue a store; dropped (False) when the sidecar is down or the queue is full
        (in jobs, or in bytes: a slow sidecar never lets stores pile up in memory)."""
        if not self.breaker.closed:
            return False
        size = job.nbytes
        with self._bytes_lock:
            queued = self._queued_bytes
            if self._max_bytes is not None and queued and queued + size > self._max_bytes:
                log.warning(
                    "sidecar store queue holds %d bytes; dropping %d blocks (%d bytes)",
                    queued,
                    len(job.blocks),
                    size,
                    extra={"session_id": job.session},
                )
                return False
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                log.warning(
                    "sidecar store queue full; dropping %d blocks",
                    len(job.blocks),
                    extra={"session_id": job.session},
                )
                return False
            self._queued_bytes += size
        return True

    @property
    def pending(self) -> int:
        return self._jobs.unfinished_tasks

    @property
    def pending_bytes(self) -> int:
        return self._queued_bytes

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until every queued store has reached the sidecar (tests, benchmarks).

        PUT has no reply in the lm:// protocol, so a round trip on the storer's own
        connection after them is what tells us the sidecar has taken them in.
        """
        deadline = time.monotonic() + timeout
        if self.breaker.closed:
            with contextlib.suppress(queue.Full):
                self._jobs.put(StoreJob([], "-", barrier=True), timeout=timeout)
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)

    def _store_loop(self) -> None:
        client: BlockClient | None = None
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    if client is not None:
                        client.close()
                    return
                if client is None:
                    client = self._make_client()
                self._store(client, job)
            except Exception as exc:
                self._failed("put", exc)
                if client is not None:
                    client.close()
                client = None
            finally:
                if job is not None:
                    with self._bytes_lock:
                        self._queued_bytes -= job.nbytes
                self._jobs.task_done()

    def _store(self, client: BlockClient, job: StoreJob) -> None:
        if job.barrier:
            client.health()
            return
        for key, kv in job.blocks:
            if not self.breaker.closed:
                return
            client.put(
                key,
                self.shape.to_wire(kv),
                fmt=self.shape.fmt,
                dtype=self.shape.dtype_code,
                shape=self.shape.wire_shape(int(kv.shape[3])),
            )
        self.breaker.success()
        log.debug(
            "stored %d blocks in the sidecar", len(job.blocks), extra={"session_id": job.session}
        )

    def close(self) -> None:
        self._jobs.put(None, timeout=30)
        self._storer.join(timeout=30)
        if self._lookup_client is not None:
            self._lookup_client.close()
