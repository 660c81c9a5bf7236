"""Every manager operation against a real Redis, through the real client (in-process)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from cache_manager.client import ManagerClient
from cache_manager.keys import new_session_id, valid_session_id
from cache_manager.protocol import AppendTurn, BeginTurn, CreateSession, UpdateSession
from cache_manager.tokens import SMALL, pack_tokens, unpack_tokens
from ctxcache.errors import (
    InvalidRequest,
    InvalidTTL,
    QuotaExceeded,
    SessionBusy,
    SessionNotFound,
    VersionConflict,
)
from tests.cache_manager.conftest import ManagerFactory

MSGS = [{"role": "user", "content": "héllo \u2603"}, {"role": "assistant", "content": "hi"}]


def chat(tenant: str = "acme", tokens: list[int] | None = None, **kw: object) -> CreateSession:
    return CreateSession(
        tenant=tenant,
        model="tiny",
        kind="chat",
        tokens=[1, 2, 3] if tokens is None else tokens,
        messages=MSGS,
        **kw,
    )  # type: ignore[arg-type]


def test_ids_are_unguessable_and_tokens_pack_compactly() -> None:
    ids = {new_session_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(valid_session_id(i) for i in ids)
    assert all(len(i) == 36 for i in ids)  # "ctx_" + 32 chars of base64url = 192 bits
    big = [0, 1, 151_643, 2**32 - 1]
    assert unpack_tokens(pack_tokens(big)) == big
    assert len(pack_tokens(range(1000))) == 4000
    with pytest.raises(ValueError):
        pack_tokens([-1])
    # short lists are checked and packed in plain Python, long ones with numpy: alike
    for n in (SMALL - 1, SMALL, SMALL + 1):
        ids = [2**32 - 1 - i for i in range(n)]
        assert (
            pack_tokens(ids) == pack_tokens(tuple(ids)) and unpack_tokens(pack_tokens(ids)) == ids
        )
        for bad in ([True] * n, [-1] * n, [2**32] * n, [0.0] * n):
            with pytest.raises(ValueError):
                pack_tokens(bad)


async def test_begin_sends_no_messages_the_caller_holds(manager: ManagerClient) -> None:
    sid = (await manager.create(chat())).session_id  # version 1
    for known, sent in ((0, True), (1, False), (2, True)):
        req = BeginTurn(tenant="acme", lock=False, messages=True, known_version=known)
        state = await manager.begin(sid, req)
        assert state.info.version == 1 and state.tokens == [1, 2, 3]
        assert state.messages == (MSGS if sent else [])


async def test_create_get_begin_append_roundtrip(manager: ManagerClient, redis_url: str) -> None:
    info = await manager.create(
        chat(ttl=120, metadata={"user": "u1"}, worker="w0", sidecar="http://sc0")
    )
    assert valid_session_id(info.session_id)
    assert (info.model, info.kind, info.ttl, info.turns, info.version) == (
        "tiny",
        "chat",
        120,
        1,
        1,
    )
    assert info.context_tokens == 3 and info.metadata == {"user": "u1"}
    assert info.affinity == "w0" and info.expires_at >= info.created + 119

    got = await manager.get(info.session_id, "acme")
    assert got == info

    state = await manager.begin(info.session_id, BeginTurn(tenant="acme", messages=True))
    assert state.tokens == [1, 2, 3] and state.messages == MSGS and state.lock
    new = await manager.append(
        info.session_id,
        AppendTurn(
            tenant="acme",
            expected_version=state.info.version,
            lock=state.lock,
            tokens=[4, 5],
            messages=[{"role": "user", "content": "more"}],
        ),
    )
    assert (new.version, new.turns, new.context_tokens) == (2, 2, 5)
    state = await manager.begin(info.session_id, BeginTurn(tenant="acme", messages=True))
    assert state.tokens == [1, 2, 3, 4, 5] and len(state.messages) == 3

    # stored compactly: 4 bytes a token, not a JSON list
    r = redis.Redis.from_url(redis_url)
    assert r.strlen(f"ctx:{{{info.session_id}}}:t") == 20
    assert 0 < r.pttl(f"ctx:{{{info.session_id}}}") <= 120_000
    r.close()


async def test_append_is_compare_and_set(manager: ManagerClient) -> None:
    info = await manager.create(chat())
    await manager.append(info.session_id, AppendTurn(tenant="acme", expected_version=1, tokens=[9]))
    with pytest.raises(VersionConflict):
        await manager.append(
            info.session_id, AppendTurn(tenant="acme", expected_version=1, tokens=[10])
        )
    state = await manager.begin(info.session_id, BeginTurn(tenant="acme", lock=False))
    assert state.tokens == [1, 2, 3, 9] and state.info.version == 2  # the stale write is gone


async def test_fifty_concurrent_appends_lose_nothing(manager: ManagerClient) -> None:
    info = await manager.create(chat(tokens=[]))
    conflicts = 0

    async def writer(n: int) -> None:
        nonlocal conflicts
        while True:
            state = await manager.begin(
                info.session_id, BeginTurn(tenant="acme", lock=False, tokens=False)
            )
            try:
                await manager.append(
                    info.session_id,
                    AppendTurn(
                        tenant="acme",
                        expected_version=state.info.version,
                        tokens=[1000 + n],
                        messages=[{"role": "user", "content": str(n)}],
                    ),
                )
                return
            except VersionConflict:
                conflicts += 1

    await asyncio.gather(*(writer(n) for n in range(50)))
    state = await manager.begin(
        info.session_id, BeginTurn(tenant="acme", lock=False, messages=True)
    )
    assert sorted(state.tokens) == [1000 + n for n in range(50)]  # each exactly once
    assert sorted(int(m["content"]) for m in state.messages[2:]) == list(range(50))
    assert state.info.turns == 51 and state.info.version == 51
    assert state.info.context_tokens == 50
    assert conflicts > 0  # the writers really raced


async def test_turn_lock_refuses_a_second_turn_and_expires(make_manager) -> None:  # type: ignore[no-untyped-def]
    async with make_manager(lock_ttl_ms=300) as manager:
        info = await manager.create(chat())
        first = await manager.begin(info.session_id, BeginTurn(tenant="acme"))
        with pytest.raises(SessionBusy) as busy:
            await manager.begin(info.session_id, BeginTurn(tenant="acme"))
        assert 50 <= busy.value.retry_after_ms <= 2000
        # a lock-free reader (session_append: false) is not blocked
        await manager.begin(info.session_id, BeginTurn(tenant="acme", lock=False))
        # another writer's append is refused while the lock is held
        with pytest.raises(SessionBusy):
            await manager.append(info.session_id, AppendTurn(tenant="acme", expected_version=1))
        await manager.release(info.session_id, "acme", first.lock or "")
        second = await manager.begin(info.session_id, BeginTurn(tenant="acme"))
        # the holder "crashes": its lock expires and the next turn takes it
        await asyncio.sleep(0.45)
        third = await manager.begin(info.session_id, BeginTurn(tenant="acme"))
        assert third.lock != second.lock
        # appending with our lock releases it
        await manager.append(
            info.session_id,
            AppendTurn(tenant="acme", expected_version=1, lock=third.lock, tokens=[7]),
        )
        await manager.begin(info.session_id, BeginTurn(tenant="acme"))


async def test_ttl_expiry_removes_session_and_listing(make_manager) -> None:  # type: ignore[no-untyped-def]
    async with make_manager() as manager:
        short = await manager.create(chat(ttl=1))
        long = await manager.create(chat(ttl=60))
        listed = await manager.list("acme")
        assert {s.session_id for s in listed.data} == {short.session_id, long.session_id}
        await asyncio.sleep(1.3)
        with pytest.raises(SessionNotFound):
            await manager.get(short.session_id, "acme")
        with pytest.raises(SessionNotFound):
            await manager.begin(short.session_id, BeginTurn(tenant="acme"))
        listed = await manager.list("acme")
        assert [s.session_id for s in listed.data] == [long.session_id]
        assert (await manager.usage("acme")).sessions == 1


async def test_sliding_ttl_and_update(manager: ManagerClient) -> None:
    info = await manager.create(chat(ttl=100))
    updated = await manager.update(info.session_id, UpdateSession(tenant="acme", ttl=5000))
    assert updated.ttl == 5000 and updated.expires_at >= info.expires_at + 4890
    with pytest.raises(InvalidTTL):
        await manager.update(info.session_id, UpdateSession(tenant="acme", ttl=10**9))
    with pytest.raises(InvalidTTL):
        await manager.create(chat(ttl=0))
    touched = await manager.begin(info.session_id, BeginTurn(tenant="acme", lock=False, touch=True))
    assert touched.info.expires_at >= updated.expires_at


async def test_tenants_are_isolated_everywhere(manager: ManagerClient) -> None:
    info = await manager.create(chat("acme"))
    sid = info.session_id
    for call in (
        manager.get(sid, "evil"),
        manager.begin(sid, BeginTurn(tenant="evil")),
        manager.append(sid, AppendTurn(tenant="evil", expected_version=1, tokens=[1])),
        manager.update(sid, UpdateSession(tenant="evil", ttl=100)),
        manager.delete(sid, "evil"),
        manager.release(sid, "evil", "x"),
    ):
        with pytest.raises(SessionNotFound):
            await call
    assert (await manager.list("evil")).data == []
    state = await manager.begin(sid, BeginTurn(tenant="acme", lock=False))
    assert state.tokens == [1, 2, 3] and state.info.version == 1  # untouched


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "x",
        "ctx_",
        "ctx_" + "a" * 31,
        "ctx_" + "a" * 33,
        "ctx_" + "}" * 32,
        "ctx_" + "a/b" * 10 + "cd",
        "../../etc",
    ],
)
async def test_malformed_ids_are_not_found(manager: ManagerClient, bad: str) -> None:
    with pytest.raises(SessionNotFound):
        await manager.get(bad or "%20", "acme")


async def test_delete_and_pagination(manager: ManagerClient) -> None:
    ids = [(await manager.create(chat())).session_id for _ in range(5)]
    page1 = await manager.list("acme", limit=2)
    page2 = await manager.list("acme", limit=2, after=page1.last_id)
    page3 = await manager.list("acme", limit=2, after=page2.last_id)
    seen = [s.session_id for p in (page1, page2, page3) for s in p.data]
    assert sorted(seen) == sorted(ids) and len(seen) == 5
    assert page1.has_more and page2.has_more and not page3.has_more
    await manager.delete(ids[0], "acme")
    with pytest.raises(SessionNotFound):
        await manager.get(ids[0], "acme")
    with pytest.raises(SessionNotFound):
        await manager.delete(ids[0], "acme")
    assert ids[0] not in {s.session_id for s in (await manager.list("acme", limit=100)).data}
    with pytest.raises(InvalidRequest):
        await manager.list("acme", limit=0)


async def test_quotas(make_manager) -> None:  # type: ignore[no-untyped-def]
    quotas = {"small": {"max_sessions": 2, "max_context_tokens": 10}}
    async with make_manager(tenant_quotas=quotas) as manager:
        a = await manager.create(chat("small", tokens=[1] * 4))
        await manager.create(chat("small", tokens=[1] * 4))
        with pytest.raises(QuotaExceeded):
            await manager.create(chat("small"))
        await manager.create(chat("other"))  # other tenants are not affected
        await manager.delete(a.session_id, "small")
        c = await manager.create(chat("small", tokens=[1] * 6))  # 4 + 6 = 10 tokens
        usage = await manager.usage("small")
        assert (usage.sessions, usage.context_tokens) == (2, 10)
        # the tenant is at its token quota: the next turn is refused before inference
        with pytest.raises(QuotaExceeded):
            await manager.begin(c.session_id, BeginTurn(tenant="small"))
        # ...and the refused turn did not keep the lock
        await manager.begin(c.session_id, BeginTurn(tenant="small", lock=False))
        with pytest.raises(QuotaExceeded):
            await manager.create(chat("small", tokens=[1]))


async def test_duplicate_pregenerated_id_is_refused(manager: ManagerClient) -> None:
    sid = new_session_id()
    await manager.create(chat(session_id=sid))
    with pytest.raises(InvalidRequest):
        await manager.create(chat(session_id=sid, tokens=[5]))
    assert (await manager.begin(sid, BeginTurn(tenant="acme", lock=False))).tokens == [1, 2, 3]
    assert (await manager.usage("acme")).sessions == 1


def test_token_ids_travel_packed_and_are_checked() -> None:
    from pydantic import ValidationError

    from cache_manager.protocol import AppendTurn

    turn = AppendTurn(tenant="t", expected_version=1, tokens=[1, 2, 2**32 - 1])
    wire = turn.model_dump_json()
    assert '"tokens":"' in wire  # base64 of the packed uint32, not a JSON list
    assert AppendTurn.model_validate_json(wire).tokens == [1, 2, 2**32 - 1]
    for bad in (["x"], [-1], [2**32], "not base64!", "AAA=", [True]):
        with pytest.raises(ValidationError):
            AppendTurn(tenant="t", expected_version=1, tokens=bad)  # type: ignore[arg-type]


async def test_live_sessions_count_every_tenant(manager: ManagerClient) -> None:
    base = await manager.live_sessions()
    short = await manager.create(chat("t1", ttl=1))
    await manager.create(chat("t2"))
    gone = await manager.create(chat("t2"))
    assert await manager.live_sessions() == base + 3
    await manager.delete(gone.session_id, "t2")
    await asyncio.sleep(1.3)
    assert await manager.live_sessions() == base + 1  # one deleted, one expired
    assert short.session_id


async def test_live_sessions_count_tenants_another_manager_created(
    make_manager: ManagerFactory,
) -> None:
    """The count has no key of its own: a manager finds the tenants other managers (or
    processes before a restart) indexed by a SCAN of the store."""
    async with make_manager() as other:
        for tenant in ("elsewhere-1", "elsewhere-2"):
            await other.create(chat(tenant))
    async with make_manager() as fresh:  # has seen no tenant itself
        assert await fresh.live_sessions() >= 2


async def test_the_reasoning_rule_is_kept_with_the_session(manager: ManagerClient) -> None:
    """`reasoning_history` (docs/reasoning.md): chosen at create, read back on every
    begin, kept by a re-based turn (its ids replace the session's)."""
    default = await manager.create(chat())
    assert default.reasoning_history == "template"
    info = await manager.create(chat(reasoning_history="keep"))
    assert info.reasoning_history == "keep"
    state = await manager.begin(info.session_id, BeginTurn(tenant="acme"))
    assert state.info.reasoning_history == "keep"
    after = await manager.append(
        info.session_id,
        AppendTurn(
            tenant="acme",
            expected_version=state.info.version,
            lock=state.lock,
            tokens=[9, 8],
            messages=MSGS,
            replace=True,
        ),
    )
    assert after.reasoning_history == "keep" and after.context_tokens == 2
    state = await manager.begin(info.session_id, BeginTurn(tenant="acme", lock=False))
    assert state.tokens == [9, 8] and state.info.reasoning_history == "keep"
    with pytest.raises(ValueError):
        CreateSession(tenant="acme", model="m", kind="chat", reasoning_history="all")  # type: ignore[arg-type]
