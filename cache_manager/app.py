"""The manager app factory: settings in, app out; Redis pool and sidecar link in the lifespan."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cache_manager.metrics import ManagerMetrics
from cache_manager.ratelimits import RateLimitStore
from cache_manager.redis_url import open_store_redis, redact
from cache_manager.router import implicit, ratelimits, router, stats, tenants
from cache_manager.service import SessionService
from cache_manager.settings import ManagerSettings
from cache_manager.sidecar_link import BackgroundLink, HttpSidecarLink, SidecarLink
from cache_manager.store import SessionStore
from ctxcache.errors import InvalidAPIKey, StoreUnavailable, error_response, install_error_handlers
from ctxcache.metrics import RouteMetricsMiddleware
from ctxcache.responses import JSONResponse

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")  # answered without the manager token: they name no one


def create_app(settings: ManagerSettings, *, sidecar_link: SidecarLink | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        link = BackgroundLink(
            sidecar_link
            or HttpSidecarLink(timeout_s=settings.sidecar_timeout_s, token=settings.sidecar_token)
        )
        async with open_store_redis(settings.redis_url, timeout_s=settings.redis_timeout_s) as r:
            store = SessionStore(
                r,
                wait_replicas=settings.redis_wait_replicas,
                wait_timeout_ms=settings.redis_wait_timeout_ms,
            )
            app.state.service = SessionService(store, settings, link)
            app.state.rate_limits = RateLimitStore(r)
            log.info("manager ready, redis at %s", redact(settings.redis_url))
            try:
                yield
            finally:
                await app.state.service.drain()
                await link.aclose()

    app = FastAPI(title="ctxcache manager", lifespan=lifespan, default_response_class=JSONResponse)
    app.state.token = settings.token
    metrics = ManagerMetrics()
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(tenants)
    app.include_router(stats)
    app.include_router(implicit)
    app.include_router(ratelimits)

    if settings.token:
        expected = f"Bearer {settings.token}".encode()

        @app.middleware("http")
        async def require_token(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            given = request.headers.get("authorization", "").encode()
            # the open paths answer without a token; /health not to a wrong one: a gateway
            # whose token is not ours learns it from its health check (its /ready says so)
            path = request.url.path
            open_path = path in OPEN_PATHS and not (given and path == "/health")
            if not open_path and not hmac.compare_digest(given, expected):
                return error_response(InvalidAPIKey("missing or invalid manager token"))
            return await call_next(request)

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        svc: SessionService = request.app.state.service
        if not await svc.store.ping():
            raise StoreUnavailable()
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus(request: Request) -> Response:
        svc: SessionService = request.app.state.service
        try:
            up = await svc.store.ping()
        except StoreUnavailable:
            up = False
        return Response(metrics.render(up), media_type=CONTENT_TYPE_LATEST)

    # outermost: requests the token check refuses are counted too
    app.add_middleware(RouteMetricsMiddleware, observe=metrics.observe)
    return app
