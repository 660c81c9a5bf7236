"""The manager's `GET /metrics`: Prometheus can scrape it without the manager token, and it
says what the manager answered (by route template, never an id), whether its Redis
answers, and what its process costs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from asgi_lifespan import LifespanManager

from cache_manager.app import create_app
from cache_manager.settings import ManagerSettings
from ctxcache.redis_server import RedisServer
from tests.cache_manager.conftest import FakeSidecarLink
from tests.utils import metric

TOKEN = "a-manager-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
UNKNOWN = "ctx_" + "A" * 32


@asynccontextmanager
async def manager(redis_url: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(
        ManagerSettings(redis_url=redis_url, token=TOKEN), sidecar_link=FakeSidecarLink()
    )
    async with (
        LifespanManager(app) as running,
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=running.app), base_url="http://manager"
        ) as http,
    ):
        yield http


async def test_metrics_count_requests_by_route_and_need_no_token(redis_url: str) -> None:
    async with manager(redis_url) as http:
        body = {"tenant": "t", "model": "m", "kind": "completion"}
        assert (await http.post("/sessions", json=body, headers=AUTH)).status_code == 200
        r = await http.get(f"/sessions/{UNKNOWN}", params={"tenant": "t"}, headers=AUTH)
        assert r.status_code == 404
        assert (await http.post("/sessions", json=body)).status_code == 401  # no token

        r = await http.get("/metrics")  # without the token, like /health
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        text = r.text
    requests = "ctxcache_manager_requests_total"
    assert metric(text, f'{requests}{{route="/sessions",status="200"}}') == 1
    assert metric(text, f'{requests}{{route="/sessions/{{session_id}}",status="404"}}') == 1
    # refused before routing: counted, under no route
    assert metric(text, f'{requests}{{route="other",status="401"}}') == 1
    assert UNKNOWN not in text and '"t"' not in text  # templates, never ids or tenants
    latency = 'ctxcache_manager_request_seconds_count{route="/sessions"}'
    assert metric(text, latency) == 1
    assert metric(text, "ctxcache_manager_store_up") == 1
    # the process: what the dashboard's Processes row reads for every service
    assert metric(text, "process_resident_memory_bytes") > 0
    assert metric(text, "process_cpu_seconds_total") > 0
    assert metric(text, "process_open_fds") > 0


async def test_metrics_answer_while_redis_is_down(own_redis: RedisServer) -> None:
    async with manager(own_redis.url) as http:
        own_redis.stop()
        r = await http.get("/metrics")
        assert r.status_code == 200  # Prometheus still sees the manager: up == 1
        assert metric(r.text, "ctxcache_manager_store_up") == 0
        assert (await http.get("/health")).status_code == 503
