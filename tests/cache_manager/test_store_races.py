"""Writes retried after a lost reply, and the tenant index racing a DELETE, on a real Redis."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from cache_manager.keys import new_session_id, tenant_keys
from cache_manager.redis_url import open_store_redis
from cache_manager.store import SessionStore
from cache_manager.tenant_index import INDEX_GRACE_MS
from ctxcache.errors import SessionBusy


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[SessionStore]:
    async with open_store_redis(redis_url, timeout_s=2.0) as r:
        yield SessionStore(r)


async def make(store: SessionStore, tenant: str = "acme") -> tuple[str, dict[str, object], int]:
    sid = new_session_id()
    exp = await store.reserve(
        tenant, sid, ttl=600, tokens=2, max_sessions=100, max_tokens=1_000_000
    )
    now = int(time.time() * 1000)
    fields: dict[str, object] = {
        "tenant": tenant,
        "model": "m",
        "kind": "chat",
        "created": now,
        "last_used": now,
        "ttl": 600,
        "expires_at": exp,
        "turns": 1,
        "version": 1,
        "context_tokens": 2,
        "affinity": "",
        "sidecar": "",
        "metadata": b"{}",
    }
    assert await store.create(sid, fields, exp, [1, 2], [{"role": "system", "content": "s"}])
    return sid, fields, exp


async def test_a_retried_create_begin_and_append_write_once(store: SessionStore) -> None:
    sid, fields, exp = await make(store)
    assert await store.create(sid, fields, exp, [1, 2], [])  # its own record: success
    other = {**fields, "created": int(fields["created"]) + 1}  # type: ignore[call-overload]
    assert not await store.create(sid, other, exp, [1, 2], [])  # someone else's: taken
    for _ in range(2):  # the retry finds its own lock token
        info, ids, _, _ = await store.begin(
            sid, "acme", lock="tok", lock_ttl_ms=5000, tokens=True, messages=False, touch=False
        )
        assert info.version == 1 and ids == [1, 2]
    with pytest.raises(SessionBusy):  # another turn's token is still refused
        await store.begin(
            sid, "acme", lock="other", lock_ttl_ms=5000, tokens=False, messages=False, touch=False
        )
    turn = {"role": "user", "content": "q"}
    kw = {"expected_version": 1, "lock": "tok", "tokens": [3], "worker": None, "sidecar": None}
    first, _ = await store.append(sid, "acme", messages=[turn], **kw)  # type: ignore[arg-type]
    again, _ = await store.append(sid, "acme", messages=[turn], **kw)  # type: ignore[arg-type]
    assert first.version == again.version == 2
    assert again.context_tokens == 3 and again.turns == 2
    _, ids, msgs, _ = await store.begin(
        sid, "acme", lock=None, lock_ttl_ms=0, tokens=True, messages=True, touch=False
    )
    assert ids == [1, 2, 3] and msgs.count(turn) == 1


async def test_a_late_index_update_does_not_resurrect_a_deleted_session(
    store: SessionStore,
) -> None:
    sid, _, _ = await make(store)
    info, _, _, _ = await store.begin(
        sid, "acme", lock=None, lock_ttl_ms=0, tokens=False, messages=False, touch=False
    )
    await store.delete(sid, "acme")
    await store.unindex("acme", sid)
    await store.record(info)  # a turn's background index write, arriving after the DELETE
    assert await store.usage("acme") == (0, 0)
    assert await store.list("acme", limit=10, after=None) == ([], False)
    # a client that deliberately creates the id again is indexed again
    await store.reserve("acme", sid, ttl=60, tokens=1, max_sessions=10, max_tokens=10)
    assert (await store.usage("acme"))[0] == 1


async def test_listing_drops_an_index_entry_whose_record_is_gone(
    store: SessionStore, redis_url: str
) -> None:
    kept, _, _ = await make(store)
    lost, _, _ = await make(store)
    young, _, _ = await make(store)
    raw = aioredis.Redis.from_url(redis_url)
    try:  # as if a failover lost the last writes of two sessions' slot, not the index's
        await raw.delete(f"ctx:{{{lost}}}", f"ctx:{{{young}}}")
        old = int(time.time() * 1000) - INDEX_GRACE_MS - 1000
        await raw.zadd(tenant_keys("acme")[1], {lost: old})
    finally:
        await raw.aclose()
    listed, _ = await store.list("acme", limit=10, after=None)
    assert [i.session_id for i in listed] == [kept]
    # the old entry leaves the index; a young one may be a create in progress: it stays
    assert (await store.usage("acme"))[0] == 2
