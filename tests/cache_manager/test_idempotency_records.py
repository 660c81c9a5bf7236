"""What an idempotency record binds, and how long it lives, in the manager on a real Redis:

* every script reads a record alike: bound by a recorded answer or by an attempt that still
  runs; a record whose attempt ended without writing binds nothing (a turn's `begin`, a
  create's `claim` and a conversation's `items` agree);
* a session's records go with it: DELETE leaves none of their answers behind, only a
  marker of the key that created the session, so a create retried after the DELETE does
  not make the session again (`idempotency_key_reused`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from cache_manager.client import ManagerClient
from cache_manager.keys import new_session_id
from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    ClaimKey,
    CreateSession,
    EditItems,
)
from ctxcache.errors import IdempotencyKeyReused, RequestInProgress, SessionNotFound
from tests.cache_manager.conftest import ManagerFactory, idem


@pytest.fixture
async def client(make_manager: ManagerFactory) -> AsyncIterator[ManagerClient]:
    async with make_manager(lock_ttl_ms=2000) as c:
        yield c


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = aioredis.Redis.from_url(redis_url)
    try:
        yield r
    finally:
        await r.aclose()


async def conversation(client: ManagerClient) -> str:
    info = await client.create(
        CreateSession(
            tenant="acme",
            model="m",
            kind="chat",
            messages=[{"role": "user", "content": "hi"}],
            origin="conversation",
        )
    )
    return info.session_id


ADD = [{"role": "user", "content": "more"}]


async def test_items_read_a_released_attempt_as_begin_does(client: ManagerClient) -> None:
    sid = await conversation(client)
    turn = await client.begin(sid, BeginTurn(tenant="acme", idempotency=idem("k", "turn")))
    assert turn.lock is not None
    await client.release(sid, "acme", turn.lock)  # the turn failed: it wrote nothing
    # begin: the key is free again, for another request too
    probe = await client.begin(sid, BeginTurn(tenant="acme", idempotency=idem("k", "other")))
    assert probe.lock is not None
    await client.release(sid, "acme", probe.lock)
    # items: the same (it answered idempotency_key_reused: the record bound nothing else)
    done = await client.items(
        sid, EditItems(tenant="acme", add=ADD, idempotency=idem("k", "items"))
    )
    assert done.info is not None and done.replay is None


async def test_items_read_a_running_attempt_as_begin_does(client: ManagerClient) -> None:
    sid = await conversation(client)
    k = idem("k", "same")
    turn = await client.begin(sid, BeginTurn(tenant="acme", idempotency=k))
    assert turn.lock is not None
    with pytest.raises(RequestInProgress):  # begin's answer to the same key while it runs
        await client.begin(sid, BeginTurn(tenant="acme", idempotency=k))
    with pytest.raises(RequestInProgress):  # items: the same (it answered session_busy)
        await client.items(sid, EditItems(tenant="acme", add=ADD, idempotency=k))
    with pytest.raises(IdempotencyKeyReused):
        await client.items(sid, EditItems(tenant="acme", add=ADD, idempotency=idem("k", "x")))


async def test_a_sessions_records_go_with_it(client: ManagerClient, redis: aioredis.Redis) -> None:
    # a conversation created with a key, a turn and an items edit with keys of their own
    created = idem("create", answer={"object": "conversation"})
    sid = new_session_id()
    claim = await client.claim(
        sid, ClaimKey(tenant="acme", idempotency=created.model_copy(update={"answer": None}))
    )
    assert claim.lock is not None
    await client.create(
        CreateSession(
            session_id=sid,
            tenant="acme",
            model="m",
            kind="chat",
            origin="conversation",
            idempotency=created,
            lock=claim.lock,
        )
    )
    t = idem("turn")
    turn = await client.begin(sid, BeginTurn(tenant="acme", idempotency=t))
    await client.append(
        sid,
        AppendTurn(
            tenant="acme",
            expected_version=turn.info.version,
            lock=turn.lock,
            tokens=[5, 6],
            idempotency=t.model_copy(update={"answer": {"object": "response"}}),
        ),
    )
    items = idem("items", answer={"object": "list"})
    await client.items(sid, EditItems(tenant="acme", add=ADD, idempotency=items))
    assert len(await redis.keys(f"ctx:{{{sid}}}:i:*")) == 3

    await client.delete(sid, "acme")

    left = await redis.keys(f"ctx:{{{sid}}}*")
    # the answers are gone; what is left is a marker of the create's key, without its answer
    assert [k.decode() for k in left] == [f"ctx:{{{sid}}}:i:{created.key}"]
    marker = await redis.hgetall(left[0])
    assert b"answer" not in marker and b"lock" not in marker
    assert 0 < await redis.pttl(left[0]) <= 600_000
    # a create retried with the key: no session made again
    with pytest.raises(IdempotencyKeyReused) as caught:
        await client.claim(
            sid, ClaimKey(tenant="acme", idempotency=created.model_copy(update={"answer": None}))
        )
    assert "deleted" in caught.value.message
    with pytest.raises(SessionNotFound):
        await client.get(sid, "acme")
