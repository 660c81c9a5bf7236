"""Redis restarts and outages, and sidecar pins that must never fail a manager operation."""

from __future__ import annotations

import pytest

from cache_manager.protocol import AppendTurn, BeginTurn, CreateSession, UpdateSession
from ctxcache.errors import StoreUnavailable
from ctxcache.redis_server import RedisServer
from tests.cache_manager.conftest import FakeSidecarLink, ManagerFactory


def chat(**kw: object) -> CreateSession:
    return CreateSession(
        tenant="acme",
        model="tiny",
        kind="chat",
        tokens=[1, 2, 3],
        messages=[{"role": "user", "content": "hi"}],
        **kw,
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("crash", [False, True], ids=["shutdown", "kill-9"])
async def test_sessions_survive_a_redis_restart_with_aof(
    own_redis: RedisServer, make_manager: ManagerFactory, crash: bool
) -> None:
    async with make_manager(redis_url=own_redis.url) as manager:
        infos = [await manager.create(chat()) for _ in range(20)]
        await manager.append(
            infos[0].session_id, AppendTurn(tenant="acme", expected_version=1, tokens=[4])
        )
        own_redis.stop(kill=crash)
        own_redis.start()
        for info in infos:
            state = await manager.begin(info.session_id, BeginTurn(tenant="acme", lock=False))
            assert state.info.tenant == "acme"
        state = await manager.begin(infos[0].session_id, BeginTurn(tenant="acme", lock=False))
        assert state.tokens == [1, 2, 3, 4] and state.info.version == 2
        assert len((await manager.list("acme", limit=100)).data) == 20


async def test_redis_down_gives_store_unavailable_then_recovers(
    own_redis: RedisServer, make_manager: ManagerFactory
) -> None:
    async with make_manager(redis_url=own_redis.url, redis_timeout_s=0.5) as manager:
        info = await manager.create(chat())
        sid = info.session_id
        own_redis.stop()
        assert not await manager.health()
        for call in (
            manager.create(chat()),
            manager.get(sid, "acme"),
            manager.list("acme"),
            manager.begin(sid, BeginTurn(tenant="acme")),
            manager.append(sid, AppendTurn(tenant="acme", expected_version=1, tokens=[9])),
            manager.update(sid, UpdateSession(tenant="acme", ttl=100)),
            manager.delete(sid, "acme"),
            manager.usage("acme"),
        ):
            with pytest.raises(StoreUnavailable):
                await call
        own_redis.start()  # same port, same AOF: no manager restart
        assert await manager.health()
        state = await manager.begin(sid, BeginTurn(tenant="acme", lock=False))
        assert state.tokens == [1, 2, 3] and state.info.version == 1  # nothing half-written
        await manager.create(chat())


async def test_sidecar_is_told_to_pin_extend_move_and_drop(
    manager,
    sidecar_link: FakeSidecarLink,  # type: ignore[no-untyped-def]
) -> None:
    info = await manager.create(chat(worker="w0", sidecar="http://sc0", ttl=100))
    sid = info.session_id
    state = await manager.begin(sid, BeginTurn(tenant="acme"))
    moved = await manager.append(
        sid,
        AppendTurn(
            tenant="acme",
            expected_version=1,
            lock=state.lock,
            tokens=[5],
            worker="w1",
            sidecar="http://sc1",
        ),
    )
    assert moved.affinity == "w1" and moved.sidecar == "http://sc1"
    patched = await manager.update(sid, UpdateSession(tenant="acme", ttl=500))
    await manager.delete(sid, "acme")
    await manager_drain(manager)
    assert sidecar_link.calls == [
        ("pin", "http://sc0", sid, info.expires_at),
        ("drop", "http://sc0", sid, None),  # the session moved to w1's sidecar
        ("pin", "http://sc1", sid, moved.expires_at),
        ("pin", "http://sc1", sid, patched.expires_at),
        ("drop", "http://sc1", sid, None),
    ]


async def test_a_sidecar_that_is_down_never_fails_an_operation(
    make_manager: ManagerFactory,
) -> None:
    failing = FakeSidecarLink(fail=True)
    async with make_manager(link=failing) as manager:
        info = await manager.create(chat(worker="w0", sidecar="http://sc0"))
        sid = info.session_id
        await manager.append(sid, AppendTurn(tenant="acme", expected_version=1, tokens=[1]))
        await manager.update(sid, UpdateSession(tenant="acme", ttl=300))
        await manager.delete(sid, "acme")
        await manager_drain(manager)
    assert [c[0] for c in failing.calls] == ["pin", "pin", "pin", "drop"]


async def manager_drain(manager) -> None:  # type: ignore[no-untyped-def]
    """Wait for the background sidecar calls of an in-process manager."""
    await manager.service.drain()
