"""The control API app; its lifespan runs the sidecar (data port, tiers, reaper)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ctxcache.errors import install_error_handlers
from ctxcache.responses import JSONResponse
from sidecar.api import open_router, router
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings


def create_app(settings: SidecarSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sidecar = await asyncio.to_thread(Sidecar(settings).start)  # scans the disk tier
        app.state.sidecar = sidecar
        try:
            yield
        finally:
            await asyncio.to_thread(sidecar.stop)

    app = FastAPI(
        title="ctxcache KV sidecar",
        lifespan=lifespan,
        default_response_class=JSONResponse,
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    app.include_router(open_router)
    app.include_router(router)
    return app
