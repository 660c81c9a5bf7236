"""Idempotency records, claims, lock renewal and conversation items in the manager, on a
real Redis: in process, and the same calls against the `ctxcache manager` process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cache_manager.client import ManagerClient
from cache_manager.keys import new_session_id
from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    ClaimKey,
    CreateSession,
    EditItems,
)
from ctxcache.errors import (
    IdempotencyKeyReused,
    RequestInProgress,
    SessionBusy,
    SessionNotFound,
    VersionConflict,
)
from tests.cache_manager.conftest import ManagerFactory, idem
from tests.utils import ServiceProcess


@pytest.fixture(params=["in-process", "http"])
async def client(
    request: pytest.FixtureRequest, make_manager: ManagerFactory, redis_url: str, tmp_path: Path
) -> AsyncIterator[ManagerClient]:
    if request.param == "in-process":
        async with make_manager(lock_ttl_ms=600) as c:
            yield c
        return
    with ServiceProcess(
        ["manager", "--redis-url", redis_url],
        log_path=tmp_path / "manager.log",
        env={"CTX_MANAGER_LOCK_TTL_MS": "600", "CTX_MANAGER_MIN_TTL": "1"},
    ) as proc:
        c = ManagerClient.over_http(proc.url)
        try:
            yield c
        finally:
            await c.aclose()


async def session(client: ManagerClient, origin: str = "context") -> str:
    info = await client.create(
        CreateSession(
            tenant="acme",
            model="tiny",
            kind="chat",
            tokens=[1, 2],
            messages=[{"role": "user", "content": "hi"}],
            origin=origin,  # type: ignore[arg-type]
        )
    )
    return info.session_id


async def test_a_turn_records_its_answer_and_a_retry_gets_it(client: ManagerClient) -> None:
    sid = await session(client)
    k = idem("k1")
    state = await client.begin(sid, BeginTurn(tenant="acme", idempotency=k))
    assert state.replay is None and state.lock and state.lock_ttl_ms == 600
    # while it runs: the same key is in progress, another body is a reuse, another key busy
    with pytest.raises(RequestInProgress):
        await client.begin(sid, BeginTurn(tenant="acme", idempotency=k))
    with pytest.raises(IdempotencyKeyReused):
        await client.begin(sid, BeginTurn(tenant="acme", idempotency=idem("k1", "other")))
    with pytest.raises(SessionBusy):
        await client.begin(sid, BeginTurn(tenant="acme", idempotency=idem("k2")))
    answer = {"id": "chatcmpl-1", "choices": [{"text": "ok"}]}
    info = await client.append(
        sid,
        AppendTurn(
            tenant="acme",
            expected_version=state.info.version,
            lock=state.lock,
            tokens=[3, 4],
            idempotency=k.model_copy(update={"answer": answer}),
        ),
    )
    assert info.turns == 2 and info.context_tokens == 4
    for lock in (True, False):  # a retry finds it, with or without asking for the lock
        again = await client.begin(sid, BeginTurn(tenant="acme", lock=lock, idempotency=k))
        assert again.replay is not None and again.lock is None
        assert again.replay.answer == answer
        assert again.replay.session == {
            "session_id": sid,
            "context_tokens": 4,
            "expires_at": info.expires_at,
        }
    with pytest.raises(IdempotencyKeyReused):
        await client.begin(sid, BeginTurn(tenant="acme", idempotency=idem("k1", "other")))
    # nothing was locked by the replays: the next turn runs
    nxt = await client.begin(sid, BeginTurn(tenant="acme"))
    assert nxt.lock is not None
    # another tenant learns nothing about the key
    with pytest.raises(SessionNotFound):
        await client.begin(sid, BeginTurn(tenant="evil", idempotency=k))


async def test_an_attempt_that_wrote_nothing_binds_nothing(client: ManagerClient) -> None:
    sid = await session(client)
    k = idem("k")
    state = await client.begin(sid, BeginTurn(tenant="acme", idempotency=k))
    assert state.lock is not None
    await client.release(sid, "acme", state.lock)  # the attempt failed: nothing appended
    # the key is free again, for this body or another
    retry = await client.begin(sid, BeginTurn(tenant="acme", idempotency=idem("k", "fixed")))
    assert retry.replay is None and retry.lock is not None


async def test_a_create_claims_its_derived_id(client: ManagerClient) -> None:
    sid = new_session_id()
    k = idem("c")
    claim = await client.claim(sid, ClaimKey(tenant="acme", idempotency=k))
    assert claim.lock and claim.replay is None
    with pytest.raises(RequestInProgress):
        await client.claim(sid, ClaimKey(tenant="acme", idempotency=k))
    with pytest.raises(IdempotencyKeyReused):
        await client.claim(sid, ClaimKey(tenant="acme", idempotency=idem("c", "other")))
    answer = {"object": "conversation", "id": "conv_x"}
    info = await client.create(
        CreateSession(
            session_id=sid,
            tenant="acme",
            model="tiny",
            kind="chat",
            tokens=[1],
            idempotency=k.model_copy(update={"answer": answer}),
            lock=claim.lock,
        )
    )
    replay = await client.claim(sid, ClaimKey(tenant="acme", idempotency=k))
    assert replay.replay is not None and replay.replay.answer == answer
    assert replay.replay.session["expires_at"] == info.expires_at
    # the create released the claim's lock: the session takes turns at once
    assert (await client.begin(sid, BeginTurn(tenant="acme"))).lock is not None
    # a session made without a claim cannot be claimed by a key
    other = await session(client)
    with pytest.raises(IdempotencyKeyReused):
        await client.claim(other, ClaimKey(tenant="acme", idempotency=idem("late")))


async def test_a_claim_given_back_frees_the_key(client: ManagerClient) -> None:
    sid = new_session_id()
    claim = await client.claim(sid, ClaimKey(tenant="acme", idempotency=idem("g")))
    assert claim.lock is not None
    await client.release(sid, "acme", claim.lock)  # no session: the token is the check
    with pytest.raises(SessionNotFound):
        await client.release(sid, "acme", "not-the-token")
    again = await client.claim(sid, ClaimKey(tenant="acme", idempotency=idem("g", "new")))
    assert again.lock is not None


async def test_a_renewed_lock_outlives_its_ttl(client: ManagerClient) -> None:
    sid = await session(client)
    state = await client.begin(sid, BeginTurn(tenant="acme"))
    assert state.lock is not None
    for _ in range(6):  # 1.2 s: twice the TTL
        await asyncio.sleep(0.2)
        assert await client.renew(sid, "acme", state.lock)
    with pytest.raises(SessionBusy):
        await client.begin(sid, BeginTurn(tenant="acme"))
    assert not await client.renew(sid, "acme", "someone-else")
    await asyncio.sleep(0.8)  # no longer renewed: it runs out
    assert not await client.renew(sid, "acme", state.lock)
    assert (await client.begin(sid, BeginTurn(tenant="acme"))).lock is not None


async def test_conversation_items_edit_messages_and_drop_the_token_ids(
    client: ManagerClient,
) -> None:
    sid = await session(client, origin="conversation")
    state = await client.begin(sid, BeginTurn(tenant="acme", lock=False, messages=True))
    v = state.info.version
    added = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    done = await client.items(sid, EditItems(tenant="acme", add=added, expected_version=v))
    assert done.info is not None and done.info.context_tokens == 0
    assert done.info.edited == done.info.version == v + 1
    with pytest.raises(VersionConflict):
        await client.items(sid, EditItems(tenant="acme", delete=0, expected_version=v))
    await client.items(sid, EditItems(tenant="acme", delete=1))
    after = await client.begin(sid, BeginTurn(tenant="acme", lock=False, messages=True))
    assert [m["content"] for m in after.messages] == ["hi", "b"] and after.tokens == []
    with pytest.raises(SessionNotFound):  # no such place
        await client.items(sid, EditItems(tenant="acme", delete=5))
    # a turn in flight: the items wait
    turn = await client.begin(sid, BeginTurn(tenant="acme"))
    with pytest.raises(SessionBusy):
        await client.items(sid, EditItems(tenant="acme", add=added))
    assert turn.lock is not None
    await client.release(sid, "acme", turn.lock)
    # recorded once with a key
    k = idem("items", answer={"object": "list", "data": []})
    first = await client.items(sid, EditItems(tenant="acme", add=added, idempotency=k))
    again = await client.items(sid, EditItems(tenant="acme", add=added, idempotency=k))
    assert first.info is not None and again.replay is not None
    assert again.replay.answer == {"object": "list", "data": []}
    last = await client.begin(sid, BeginTurn(tenant="acme", lock=False, messages=True))
    assert len(last.messages) == 4
    # not a conversation, or not the tenant's: not found
    plain = await session(client)
    with pytest.raises(SessionNotFound):
        await client.items(plain, EditItems(tenant="acme", add=added))
    with pytest.raises(SessionNotFound):
        await client.items(sid, EditItems(tenant="evil", add=added))
