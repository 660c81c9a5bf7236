"""The gateway's heap freeze (`gateway.app._freeze_startup_heap`) is the server process's
alone: an app run inside a test's own process leaves that process's collector as it is."""

from __future__ import annotations

import gc

from gateway.app import create_app
from gateway.settings import GatewaySettings


async def test_only_a_server_process_freezes_its_heap(redis_url: str) -> None:
    settings = GatewaySettings(redis_url=redis_url, workers=["http://127.0.0.1:1"])
    before = gc.get_freeze_count()
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() == before
    app = create_app(settings, freeze_heap=True)  # as `ctxcache gateway` makes it
    try:
        async with app.router.lifespan_context(app):
            assert gc.get_freeze_count() > before
    finally:
        gc.unfreeze()
