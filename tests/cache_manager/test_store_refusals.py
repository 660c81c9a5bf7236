"""A Redis that refuses commands (OOM under noeviction, MISCONF, BUSY, NOPERM, READONLY on a
demoted master) is a store that cannot serve now: every manager call answers
`store_unavailable` (503, naming the refusal), never an unhandled error (a 500) — the session
routes as well as the rate limits. On a real redis-server of the test's own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from cache_manager.app import create_app
from cache_manager.client import ManagerClient
from cache_manager.protocol import BeginTurn, CreateSession, RateTake
from cache_manager.settings import ManagerSettings
from ctxcache.errors import StoreUnavailable
from ctxcache.redis_server import RedisServer
from tests.cache_manager.conftest import FakeSidecarLink
from tests.cache_manager.refusals import KINDS, refusing, srv_fixture, url_of  # noqa: F401 (the srv fixture)


@pytest.fixture
async def manager(srv: RedisServer) -> AsyncIterator[ManagerClient]:
    # (a short lock TTL: a begin refused leaves a lock release retrying that long)
    settings = ManagerSettings(redis_url=url_of(srv), redis_timeout_s=2.0, lock_ttl_ms=500)
    async with ManagerClient.in_process(create_app(settings, sidecar_link=FakeSidecarLink())) as c:
        yield c


def create(tenant: str = "acme") -> CreateSession:
    return CreateSession(tenant=tenant, model="m", kind="chat", tokens=[1, 2])


@pytest.mark.parametrize("kind", KINDS)
async def test_a_refusing_redis_is_store_unavailable(
    manager: ManagerClient, srv: RedisServer, kind: str
) -> None:
    sid = (await manager.create(create())).session_id
    take = RateTake(window_ms=60_000, max_requests=10, max_tokens=0, tokens=0)
    # (a window already open: a fresh one's first write is a DEL, which Redis before 7
    # lets a script make under OOM, and the script's later writes with it)
    assert (await manager.rate_take("k" * 16, take)).allowed
    with refusing(srv, kind):
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            "rate limit": lambda: manager.rate_take("k" * 16, take),
            "create": lambda: manager.create(create()),
            "turn": lambda: manager.begin(sid, BeginTurn(tenant="acme")),
        }
        for what, call in calls.items():
            with pytest.raises(StoreUnavailable) as caught:
                await call()
            # the reason is in the message (the gateway logs it): the operator knows what to fix
            code = kind.split("-")[0].upper()
            assert code in caught.value.message, (what, caught.value.message)
    # served again once the refusal ends
    assert (await manager.rate_take("k" * 16, take)).allowed
    turn = await manager.begin(sid, BeginTurn(tenant="acme"))
    assert turn.lock is not None
