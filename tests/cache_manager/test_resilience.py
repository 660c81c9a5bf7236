"""Redis restarts and outages, and sidecar pins that must never fail a manager operation."""

from __future__ import annotations

import asyncio
import time

import pytest

from cache_manager.protocol import AppendTurn, BeginTurn, CreateSession, UpdateSession
from cache_manager.sidecar_link import BackgroundLink, headroom
from cache_manager.store_errors import redis_errors
from ctxcache.errors import SessionBusy, StoreUnavailable
from ctxcache.lmcache_keys import session_key
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


async def test_a_write_on_a_connection_uvloop_closed_is_store_unavailable() -> None:
    """What uvloop raises when redis-py writes on a connection that a killed node had just
    closed is a store outage (503, retried), not an internal error; other RuntimeErrors are
    not (tests/faults/test_topologies.py kills a cluster master mid-run for the real path)."""
    closed = RuntimeError(
        "unable to perform operation on <TCPTransport closed=True reading=False 0x55fd36>; "
        "the handler is closed"
    )
    with pytest.raises(StoreUnavailable):
        async with redis_errors():
            raise closed
    with pytest.raises(RuntimeError, match="something else"):
        async with redis_errors():
            raise RuntimeError("something else")


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


async def test_a_lock_whose_release_failed_is_given_back_once_redis_is_back(
    own_redis: RedisServer, make_manager: ManagerFactory
) -> None:
    """A turn that fails while Redis is away cannot give its lock back then (the tenant
    check fails first): the manager keeps trying, so the session is free again as soon as
    Redis is, not after the lock's whole TTL."""
    async with make_manager(redis_url=own_redis.url, redis_timeout_s=0.5) as manager:
        sid = (await manager.create(chat())).session_id
        state = await manager.begin(sid, BeginTurn(tenant="acme"))
        assert state.lock is not None and state.lock_ttl_ms == 30_000
        own_redis.stop()  # a clean shutdown: the lock is in the AOF
        with pytest.raises(StoreUnavailable):
            await manager.release(sid, "acme", state.lock)
        own_redis.start()
        deadline = time.monotonic() + 10  # a third of the lock's TTL
        while True:
            try:
                again = await manager.begin(sid, BeginTurn(tenant="acme"))
                break
            except (SessionBusy, StoreUnavailable):
                assert time.monotonic() < deadline, "the lock was never given back"
                await asyncio.sleep(0.1)
        assert again.lock is not None and again.lock != state.lock


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
    key = session_key(sid)  # the tag of the session's KV blocks
    assert sidecar_link.calls == [
        ("pin", "http://sc0", key, info.expires_at),
        ("drop", "http://sc0", key, None),  # the session moved to w1's sidecar
        ("pin", "http://sc1", key, moved.expires_at + headroom(100)),  # a turn: headroom
        ("pin", "http://sc1", key, patched.expires_at),  # a ttl change: exact
        ("drop", "http://sc1", key, None),
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


async def test_turns_pin_again_only_when_the_last_pin_no_longer_covers(
    manager,
    sidecar_link: FakeSidecarLink,  # type: ignore[no-untyped-def]
) -> None:
    info = await manager.create(chat(worker="w0", sidecar="http://sc0", ttl=100))
    sid, version = info.session_id, 1
    for _ in range(4):  # back-to-back turns: the first one's headroom covers the rest
        turn = await manager.append(
            sid,
            AppendTurn(
                tenant="acme",
                expected_version=version,
                tokens=[1],
                worker="w0",
                sidecar="http://sc0",
            ),
        )
        version = turn.version
    await manager_drain(manager)
    pins = [c for c in sidecar_link.calls if c[0] == "pin"]
    assert pins[0][3] == info.expires_at  # the create: exact
    assert len(pins) <= 2  # at most the first turn pins again (with headroom), not each turn
    assert turn.expires_at <= pins[-1][3] <= turn.expires_at + headroom(100)


async def test_a_pin_that_failed_is_made_again_by_the_next_turn() -> None:
    failing = FakeSidecarLink(fail=True)
    link = BackgroundLink(failing)
    for exp in (1000, 1001, 1002):  # each turn finds no pin it could rely on
        link.pin("http://sc0", "s1", exp, ttl=800)
        await link.background.drain()
    ok = FakeSidecarLink()
    link.link = ok
    link.pin("http://sc0", "s1", 1003, ttl=800)
    link.pin("http://sc0", "s1", 1004, ttl=800)  # covered by the one before
    link.drop("http://sc0", "s1")
    link.pin("http://sc0", "s1", 1005, ttl=800)  # dropped: pinned again
    await link.background.drain()
    calls = failing.calls + ok.calls
    assert [(c[0], c[3]) for c in calls] == [
        ("pin", 1030),
        ("pin", 1031),
        ("pin", 1032),
        ("pin", 1033),
        ("drop", None),
        ("pin", 1035),
    ]


async def manager_drain(manager) -> None:  # type: ignore[no-untyped-def]
    """Wait for the background sidecar calls of an in-process manager."""
    await manager.service.drain()
