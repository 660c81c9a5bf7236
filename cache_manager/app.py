"""The manager app factory: settings in, app out; Redis pool and sidecar link in the lifespan."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI, Request, Response
from redis import __version__ as redis_version
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo
from redis.exceptions import ConnectionError, TimeoutError

from cache_manager.router import router, stats, tenants
from cache_manager.service import SessionService
from cache_manager.settings import ManagerSettings
from cache_manager.sidecar_link import BackgroundLink, HttpSidecarLink, SidecarLink
from cache_manager.store import SessionStore
from ctxcache.errors import InvalidAPIKey, StoreUnavailable, error_response, install_error_handlers
from ctxcache.responses import JSONResponse

log = logging.getLogger(__name__)


def create_app(settings: ManagerSettings, *, sidecar_link: SidecarLink | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
            # A pooled connection that died with a Redis restart is retried once on a fresh
            # one; append is compare-and-set, so a retry can never write a turn twice.
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[ConnectionError, TimeoutError],
            health_check_interval=30,
            max_connections=256,
            # given once: otherwise every new pooled connection looks the version up in the
            # package metadata (~0.6 ms each, most of a 200-session burst's connection cost)
            driver_info=DriverInfo(lib_version=redis_version),
        )
        link = BackgroundLink(
            sidecar_link
            or HttpSidecarLink(timeout_s=settings.sidecar_timeout_s, token=settings.sidecar_token)
        )
        app.state.service = SessionService(SessionStore(redis), settings, link)
        log.info("manager ready, redis at %s", _redact(settings.redis_url))
        try:
            yield
        finally:
            await app.state.service.drain()
            await link.aclose()
            await redis.aclose()

    app = FastAPI(title="ctxcache manager", lifespan=lifespan, default_response_class=JSONResponse)
    app.state.token = settings.token
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(tenants)
    app.include_router(stats)

    if settings.token:
        expected = f"Bearer {settings.token}".encode()

        @app.middleware("http")
        async def require_token(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            given = request.headers.get("authorization", "").encode()
            if request.url.path != "/health" and not hmac.compare_digest(given, expected):
                return error_response(InvalidAPIKey("missing or invalid manager token"))
            return await call_next(request)

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        svc: SessionService = request.app.state.service
        if not await svc.store.ping():
            raise StoreUnavailable()
        return {"status": "ok"}

    return app


def _redact(url: str) -> str:
    """Never log a Redis password."""
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url
