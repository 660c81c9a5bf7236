"""The gateway app factory: settings in, app out; clients made once in the lifespan."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp

from cache_manager.app import create_app as create_manager_app
from cache_manager.client import ManagerClient
from cache_manager.settings import ManagerSettings
from ctxcache.body_limit import BodyLimitMiddleware
from ctxcache.errors import install_error_handlers
from ctxcache.metrics import RouteMetricsMiddleware
from ctxcache.responses import JSONResponse
from ctxcache.schema import ErrorResponse
from gateway.auth import KeyRing, KeysFileWatch
from gateway.completions import router as completion_routes
from gateway.completions.service import CompletionService
from gateway.components import ComponentCollector, Components
from gateway.context.router import router as context_router
from gateway.context.service import ContextService
from gateway.conversations.router import router as conversations_router
from gateway.conversations.service import ConversationService
from gateway.implicit.service import ImplicitSessions
from gateway.locks import LockKeeper
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.prompts import PromptBuilder
from gateway.protocol import ChatBody, CompletionBody, ContextCreate
from gateway.ratelimit import RateLimits
from gateway.reasoning import Reasoning
from gateway.recent import RecentHistories
from gateway.responses.protocol import (
    ConversationCreate,
    ConversationUpdate,
    ItemsCreate,
    ResponseCreate,
)
from gateway.responses.router import router as responses_router
from gateway.responses.service import ResponseService
from gateway.salt import CacheSalt
from gateway.settings import GatewaySettings
from gateway.system import router as system_router
from gateway.turns import TurnService

log = logging.getLogger(__name__)


def _rate_limits(inner: ASGIApp, app: FastAPI, settings: GatewaySettings) -> RateLimits:
    return RateLimits(
        inner,
        state=app.state,
        metrics=app.state.metrics,
        window_s=settings.rate_limit_window_s,
        on_store_error=settings.rate_limit_on_store_error,
        default_max_tokens=settings.rate_limit_default_max_tokens,
        max_body_bytes=settings.max_body_bytes,
        tenant_metrics=settings.metrics_token is not None,
    )


def create_app(settings: GatewaySettings, *, freeze_heap: bool = False) -> FastAPI:
    """The gateway's app. `freeze_heap`: once started, keep the garbage collector off what
    exists then (`_freeze_startup_heap`): for a server process (`ctxcache gateway`), not for
    a test or a tool that runs the app inside its own process."""
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            if settings.manager_url:
                manager = ManagerClient.over_http(
                    settings.manager_url, token=settings.manager_token
                )
                stack.push_async_callback(manager.aclose)
            else:  # the manager runs in this process: its service, called directly
                manager_app = create_manager_app(
                    ManagerSettings(
                        redis_url=settings.redis_url,
                        default_ttl=settings.default_ttl,
                        min_ttl=settings.min_ttl,
                        max_ttl=settings.max_ttl,
                    )
                )
                manager = await stack.enter_async_context(ManagerClient.in_process(manager_app))
            components = Components(settings.components_file)
            collector = ComponentCollector(components)
            metrics.registry.register(collector)
            stack.callback(metrics.registry.unregister, collector)
            pool = WorkerPool(
                settings.workers,
                connect_timeout_s=settings.connect_timeout_s,
                request_timeout_s=settings.request_timeout_s,
                health_interval_s=settings.health_interval_s,
                imbalance_slack=settings.imbalance_slack,
                max_inflight=settings.max_inflight_per_worker,
                components=components,
            )
            await pool.start()
            stack.push_async_callback(pool.aclose)
            salt = CacheSalt(settings.tenant_cache_salt)
            recent = RecentHistories(max_sessions=settings.recent_chat_sessions)
            keeper = LockKeeper(
                manager,
                max_hold_s=settings.request_timeout_s,
                on_renew=metrics.turn_lock_renewals.inc,
            )
            stack.push_async_callback(keeper.aclose)
            prompts = PromptBuilder()
            reasoning = Reasoning(settings.reasoning_parser)
            turns = TurnService(manager, pool, metrics, prompts, salt, recent, keeper, reasoning)
            stack.push_async_callback(turns.drain)
            app.state.components = components
            app.state.keys = KeyRing(settings.api_keys)
            if settings.api_keys_file is not None and settings.api_keys_file_poll_s > 0:
                watch = KeysFileWatch(
                    app.state.keys, settings.api_keys_file, settings.api_keys_file_poll_s
                )
                watch.start()
                stack.push_async_callback(watch.aclose)
            app.state.manager = manager
            app.state.pool = pool
            app.state.metrics = metrics
            app.state.turns = turns
            implicit = ImplicitSessions(manager, turns, pool, settings, metrics, prompts)
            stack.push_async_callback(implicit.drain)
            app.state.completions = CompletionService(
                turns,
                pool,
                salt,
                metrics,
                idempotency_ttl_s=settings.idempotency_ttl_s,
                implicit=implicit,
            )
            app.state.contexts = ContextService(manager, turns, pool, settings, metrics)
            app.state.responses = ResponseService(manager, turns, settings, metrics, implicit.new)
            app.state.conversations = ConversationService(manager, turns, settings, metrics)
            log.info(
                "gateway ready: %d worker(s), manager %s",
                len(pool.workers),
                settings.manager_url or "in-process",
            )
            if freeze_heap:
                _freeze_startup_heap()
            yield

    app = FastAPI(
        title="ctxcache",
        version="0.1.0",
        lifespan=lifespan,
        default_response_class=JSONResponse,
    )
    app.state.metrics = metrics
    app.state.idempotency_ttl_s = settings.idempotency_ttl_s
    app.state.metrics_token = settings.metrics_token
    install_error_handlers(app)
    # the busiest two first: a request is matched against the routes in order
    app.router.routes[:0] = completion_routes.routes()
    app.include_router(context_router)
    app.include_router(responses_router)
    app.include_router(conversations_router)
    app.include_router(system_router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RouteMetricsMiddleware, observe=metrics.observe)
    # outermost: every request a key with limits makes is counted (gateway/ratelimit.py)
    app.add_middleware(_rate_limits, app=app, settings=settings)  # type: ignore[arg-type]
    _document_bodies(app)
    return app


def _freeze_startup_heap() -> None:
    """Keep the garbage collector off the objects that live as long as the process.

    Python's oldest-generation collection walks every tracked object: the ~100k of the
    imported modules (FastAPI, pydantic, aiohttp, redis, ...) took 50 ms per walk, a few
    times a minute under load, and every request in flight waited for it — the whole p99
    at concurrency 32 (docs/benchmarks.md). Collect the startup garbage, then move the rest
    into the permanent generation, which collections skip; what requests allocate is
    collected as before.
    """
    gc.collect()
    gc.freeze()
    log.debug("%d startup objects frozen out of garbage collection", gc.get_freeze_count())


ERROR_DOC = {
    "description": "Any error: the OpenAI envelope (a malformed body is 400, never 422)",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
}


def _document_bodies(app: FastAPI) -> None:
    """Routes that read their raw body name its schema; put those schemas in the document.
    Every operation's errors are the OpenAI envelope: FastAPI's 422 is never answered."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        schema["paths"] = {**completion_routes.openapi_paths(), **schema["paths"]}
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        bodies = (CompletionBody, ChatBody, ContextCreate, ErrorResponse, ResponseCreate)
        for model in (*bodies, ConversationCreate, ConversationUpdate, ItemsCreate):
            doc = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(doc.pop("$defs", {}))
            components[model.__name__] = doc
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for operations in schema["paths"].values():
            for op in operations.values():
                op["responses"].pop("422", None)
                op["responses"]["default"] = ERROR_DOC
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
