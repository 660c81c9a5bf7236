"""The inference workers behind the gateway: health, load, and who serves a request.

Each worker (the built-in one or vLLM: the same HTTP contract) has one keep-alive HTTP
client (`WorkerClient`), which every call to it takes, health checks included. A
background task checks every worker's `/health` and learns its models from `/v1/models`.
Routing: a session turn goes to its affine worker (where its KV is hot) unless that
worker is down or runs more than `imbalance_slack` requests above the least-loaded
healthy one; everything else goes to the least-loaded healthy worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson

from ctxcache.errors import BackendUnavailable, NotFound
from gateway.components import Components
from gateway.settings import WorkerEndpoint
from gateway.worker_client import ConnectionLost, Misframed, WorkerClient

log = logging.getLogger(__name__)


class ModelNotFound(NotFound):
    code = "model_not_found"
    default_message = "the model does not exist or no worker serves it"


@dataclass
class Worker:
    id: str
    url: str
    sidecar: str | None
    client: WorkerClient
    healthy: bool = False
    inflight: int = 0
    models: dict[str, int] = field(default_factory=dict)  # model id -> max_model_len


class WorkerPool:
    def __init__(
        self,
        endpoints: Iterable[WorkerEndpoint],
        *,
        connect_timeout_s: float,
        request_timeout_s: float,
        health_interval_s: float,
        imbalance_slack: int,
        max_inflight: int,
        components: Components | None = None,
    ) -> None:
        self.workers = [
            Worker(
                e.id,
                e.url,
                e.sidecar,
                WorkerClient(
                    e.url,
                    connect_timeout_s=connect_timeout_s,
                    request_timeout_s=request_timeout_s,
                ),
            )
            for e in endpoints
        ]
        self.health_interval_s = health_interval_s
        self.imbalance_slack = imbalance_slack
        self.max_inflight = max_inflight
        self.components = components or Components(None)
        self._rr = itertools.count()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Check every worker once, then keep checking in the background."""
        await self.check_all()
        self._task = asyncio.get_running_loop().create_task(self._health_loop())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for w in self.workers:
            await w.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def check(self, w: Worker) -> None:
        probe = min(2.0, self.health_interval_s * 2)
        try:
            status, _ = await w.client.get("/health", timeout_s=probe)
            ok = status == 200
            if ok and not w.models:
                status, body = await w.client.get("/v1/models", timeout_s=probe)
                if status != 200:
                    raise ValueError(f"/v1/models answered {status}")
                models = orjson.loads(body)["data"]
                w.models = {m["id"]: int(m.get("max_model_len") or 0) for m in models}
        except (ConnectionLost, Misframed, TimeoutError, ValueError, KeyError, TypeError) as exc:
            ok = False
            log.debug("health check of %s failed: %s", w.id, exc)
        if ok != w.healthy:
            log.log(
                logging.INFO if ok else logging.WARNING,
                "worker %s (%s) is %s",
                w.id,
                w.url,
                "healthy" if ok else "DOWN",
            )
        w.healthy = ok

    def mark_down(self, w: Worker, reason: str) -> None:
        if w.healthy:
            log.warning("worker %s (%s) marked down: %s", w.id, w.url, reason)
        w.healthy = False

    def models(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.workers:
            if w.healthy:
                out.update(w.models)
        return out

    def unavailable(self) -> BackendUnavailable:
        """The 503 for a request no worker can take: what is (re)starting, and a
        `retry-after` of when it is expected up."""
        why = self.components.describe()
        return BackendUnavailable(
            f"{BackendUnavailable.default_message}{why}" if why else None,
            retry_after_s=self.components.retry_after_s(),
        )

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def pick(
        self, model: str, *, affinity: str | None = None, exclude: Iterable[str] = ()
    ) -> Worker:
        excluded = set(exclude) if exclude else ()
        candidates = [
            w for w in self.workers if w.healthy and model in w.models and w.id not in excluded
        ]
        if len(candidates) == 1:
            return candidates[0]
        if not candidates:
            known = any(model in w.models for w in self.workers)
            if not known and any(w.healthy for w in self.workers):
                raise ModelNotFound(f"model {model!r} does not exist", param="model")
            raise self.unavailable()
        least = min(w.inflight for w in candidates)
        if affinity is not None:
            for w in candidates:
                if (
                    w.id == affinity
                    and w.inflight <= least + self.imbalance_slack
                    and w.inflight < self.max_inflight
                ):
                    return w
        best = [w for w in candidates if w.inflight == least]
        return best[next(self._rr) % len(best)]

    def keyed(self, model: str, key: str) -> str | None:
        """The worker a `prompt_cache_key` goes to (rendezvous hashing over the healthy
        workers that serve the model: every gateway replica picks the same one, and a
        worker that leaves moves only its own keys). `pick` sends the request elsewhere
        if that worker is overloaded, as it does a session's turn."""
        candidates = [w.id for w in self.workers if w.healthy and model in w.models]
        if not candidates:
            return None
        return max(candidates, key=lambda wid: hashlib.blake2b(f"{wid}\0{key}".encode()).digest())

    def lease(self, w: Worker) -> Lease:
        """`async with pool.lease(w)`: one more request in flight on `w` meanwhile."""
        return Lease(w)


class Lease:
    """(A class, not an `asynccontextmanager`: this runs on every request.)"""

    __slots__ = ("worker",)

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def __aenter__(self) -> Worker:
        self.worker.inflight += 1
        return self.worker

    async def __aexit__(self, *exc: object) -> None:
        self.worker.inflight -= 1
