"""`/v1/models`, `/health`, `/ready`, `/metrics`."""

from __future__ import annotations

import contextlib
import hmac
import time
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import PlainTextResponse

from ctxcache.errors import CtxError, InvalidAPIKey, NotFound, StoreUnavailable
from ctxcache.responses import JSONResponse
from gateway.auth import check_given_key

router = APIRouter()
# per-tenant session gauges for at most this many tenants (one store call each per scrape)
MAX_TENANT_SERIES = 100


@router.get("/v1/models", dependencies=[Depends(check_given_key)])
async def models(request: Request) -> JSONResponse:
    # open without a key, like vLLM: it names models, nothing of any tenant; but a key it
    # is shown must be valid (SPEC.md)
    now = int(time.time())
    data = [
        {"id": m, "object": "model", "created": now, "owned_by": "ctxcache", "max_model_len": n}
        for m, n in sorted(request.app.state.pool.models().items())
    ]
    return JSONResponse({"object": "list", "data": data})


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> dict[str, Any]:
    """Readiness: the session store answers and at least one worker is healthy. Under
    `ctxcache serve`, a 503 names the components not up (an engine restarting: since when,
    and how long its last start took) and its `retry-after` is when they are expected. A
    manager service that refuses this gateway's token makes it a 503 that says so
    (`ManagerRefused`): a misconfigured gateway is never ready."""
    pool = request.app.state.pool
    if not await request.app.state.manager.health():
        why = pool.components.describe()
        raise StoreUnavailable(f"{StoreUnavailable.default_message}{why}" if why else None)
    healthy = pool.healthy()
    if not healthy:
        raise pool.unavailable()
    return {"status": "ready", "workers": len(healthy)}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> Response:
    m = request.app.state.metrics
    manager = request.app.state.manager
    try:
        up = await manager.health()
    except CtxError:  # the manager refuses this gateway: for it, no store either
        up = False
    m.store_up.set(1 if up else 0)
    if up:
        with contextlib.suppress(CtxError):  # store down: the gauges keep their last value
            m.live_sessions.set(await manager.live_sessions())
    for w in request.app.state.pool.workers:
        m.worker_inflight.labels(w.id).set(w.inflight)
        m.worker_healthy.labels(w.id).set(1 if w.healthy else 0)
    return Response(m.render(), media_type="text/plain; version=0.0.4")


@router.get("/metrics/tenants", response_class=PlainTextResponse)
async def tenant_metrics(request: Request) -> Response:
    """Per-tenant counters (requests, tokens, rate-limited, turns) and live sessions, for
    the metrics token only."""
    token: str | None = request.app.state.metrics_token
    if token is None:
        raise NotFound("per-tenant metrics are off: set CTX_GATEWAY_METRICS_TOKEN")
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, f"Bearer {token}".encode()):
        raise InvalidAPIKey("missing or invalid metrics token")
    tenants = request.app.state.metrics.tenants
    with contextlib.suppress(CtxError):  # store down: the gauges keep their last value
        for tenant in request.app.state.keys.tenants[:MAX_TENANT_SERIES]:
            usage = await request.app.state.manager.usage(tenant)
            tenants.live_sessions.labels(tenant).set(usage.sessions)
    return Response(tenants.render(), media_type="text/plain; version=0.0.4")
