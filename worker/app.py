"""`create_app(settings)`: the worker's FastAPI app, its engine built in the lifespan."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ctxcache.errors import install_error_handlers
from ctxcache.responses import JSONResponse
from worker.engine.engine import Engine
from worker.engine.runner import ModelRunner
from worker.entrypoints.chat_completions.api_router import router as chat_router
from worker.entrypoints.completions.api_router import router as completions_router
from worker.entrypoints.serving import WorkerState
from worker.entrypoints.system.api_router import router as system_router
from worker.entrypoints.tokenize.api_router import router as tokenize_router
from worker.kv.hashing import KeyMaker
from worker.kv.l1 import L1Cache
from worker.kv.layout import TORCH_TO_KEY_NAME
from worker.kv.manager import KVManager
from worker.kv.sidecar import SidecarKV, kv_client_factory, kv_path
from worker.metrics import WorkerMetrics
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def build_state(settings: WorkerSettings, runner: ModelRunner | None = None) -> WorkerState:
    """Model, KV tiers and engine for `settings` (the engine is not started)."""
    runner = runner or ModelRunner(settings.model, settings.dtype, settings.threads)
    metrics = WorkerMetrics()
    sidecar = None
    if settings.sidecar:
        local = str(settings.sidecar_local_dir) if settings.sidecar_local_dir else None
        log.info(
            "KV path %s: sidecar %s%s",
            kv_path(local),
            settings.sidecar,
            f", local dir {local}" if local else "",
        )
        sidecar = SidecarKV(
            kv_client_factory(settings.sidecar, settings.sidecar_timeout, local),
            runner.kv_shape,
            on_error=metrics.sidecar_error,
        )
    l1 = L1Cache(settings.l1_bytes)
    keys = KeyMaker(
        settings.served_name, TORCH_TO_KEY_NAME[runner.kv_shape.dtype], settings.worker_id
    )
    kv = KVManager(
        l1,
        sidecar,
        keys,
        settings.chunk_size,
        tail_blocks=settings.sidecar_tail_blocks,
        l1_tail_tokens=settings.l1_tail_tokens,
    )
    engine = Engine(
        runner, kv, max_queue=settings.max_queue, max_batch=settings.max_batch, metrics=metrics
    )
    metrics.gauge("ctxcache_worker_queue_waiting", "requests waiting", lambda: len(engine.waiting))
    metrics.gauge("ctxcache_worker_running", "sequences being decoded", lambda: len(engine.active))
    metrics.gauge("ctxcache_worker_l1_bytes", "bytes in the KV L1", lambda: l1.bytes)
    metrics.gauge(
        "ctxcache_worker_sidecar_store_pending",
        "KV stores not yet sent",
        lambda: sidecar.pending if sidecar else 0,
    )
    return WorkerState(settings, runner, engine, metrics)


def create_app(settings: WorkerSettings, runner: ModelRunner | None = None) -> FastAPI:
    """The app; pass a loaded `runner` to share one model between apps (tests)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = build_state(settings, runner)
        state.engine.start()
        app.state.worker = state
        log.info(
            "worker serving %s (sidecar %s, chunk %d)",
            state.model_name,
            settings.sidecar or "off",
            settings.chunk_size,
        )
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="ctxcache worker", lifespan=lifespan, default_response_class=JSONResponse)
    install_error_handlers(app)
    for router in (completions_router, chat_router, tokenize_router, system_router):
        app.include_router(router)
    return app
