"""Stored responses under their session's hash tag, and KV tags shared by forks."""

from __future__ import annotations

import pytest
import redis
from pydantic import ValidationError

from cache_manager.client import ManagerClient
from cache_manager.keys import session_keys
from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    CreateSession,
    StoredResponse,
    UpdateSession,
)
from ctxcache.errors import SessionNotFound
from ctxcache.lmcache_keys import session_key
from tests.cache_manager.conftest import FakeSidecarLink
from tests.cache_manager.test_resilience import manager_drain


def create(**kw: object) -> CreateSession:
    fields: dict[str, object] = {
        "tenant": "acme",
        "model": "tiny",
        "kind": "chat",
        "tokens": [1, 2, 3],
        "sidecar": "http://sc0",
        "origin": "response",
        **kw,
    }
    return CreateSession(**fields)  # type: ignore[arg-type]


async def test_a_response_is_written_with_its_turn_and_lives_as_long_as_the_session(
    manager: ManagerClient, redis_url: str
) -> None:
    info = await manager.create(
        create(ttl=100, response=StoredResponse(id="first", record={"n": 1}))
    )
    sid = info.session_id
    state = await manager.begin(sid, BeginTurn(tenant="acme"))
    await manager.append(
        sid,
        AppendTurn(
            tenant="acme",
            expected_version=1,
            lock=state.lock,
            tokens=[4],
            response=StoredResponse(id="second", record={"n": 2}),
        ),
    )
    got = await manager.get_response(sid, "acme", "second")
    assert got.record == {"n": 2} and got.version == 2
    assert (await manager.get_response(sid, "acme", "first")).version == 2
    r = redis.Redis.from_url(redis_url)
    try:
        record, responses = session_keys(sid)[0], session_keys(sid)[4]
        assert abs(r.pttl(responses) - r.pttl(record)) < 50  # one expiry for both
        await manager.update(sid, UpdateSession(tenant="acme", ttl=5000))
        assert abs(r.pttl(responses) - r.pttl(record)) < 50
    finally:
        r.close()

    for tenant, rid in [("evil", "second"), ("acme", "third")]:
        with pytest.raises(SessionNotFound):
            await manager.get_response(sid, tenant, rid)
        with pytest.raises(SessionNotFound):
            await manager.delete_response(sid, tenant, rid)
    assert (await manager.delete_response(sid, "acme", "first")).remaining == 1
    with pytest.raises(SessionNotFound):
        await manager.get_response(sid, "acme", "first")
    await manager.delete(sid, "acme")
    with pytest.raises(SessionNotFound):
        await manager.get_response(sid, "acme", "second")


async def test_a_fork_pins_its_parents_kv_tag_and_shared_blocks_are_not_dropped(
    manager: ManagerClient, sidecar_link: FakeSidecarLink
) -> None:
    parent = await manager.create(create(ttl=100))
    assert parent.kv_key == session_key(parent.session_id) and not parent.kv_shared
    await manager.update(parent.session_id, UpdateSession(tenant="acme", kv_shared=True))
    fork = await manager.create(create(ttl=100, kv_key=parent.kv_key))
    assert fork.kv_key == parent.kv_key
    await manager.delete(parent.session_id, "acme")
    await manager.delete(fork.session_id, "acme")
    lonely = await manager.create(create(ttl=100))
    await manager.delete(lonely.session_id, "acme")
    await manager_drain(manager)
    calls = [(c[0], c[2]) for c in sidecar_link.calls]
    assert calls == [
        ("pin", parent.kv_key),
        ("pin", parent.kv_key),  # the fork's create: the same tag
        ("pin", lonely.kv_key),
        ("drop", lonely.kv_key),  # only a tag nobody shares is dropped
    ]


async def test_a_conversation_takes_the_model_of_its_first_turn(manager: ManagerClient) -> None:
    info = await manager.create(create(model="", tokens=[], origin="conversation"))
    assert info.model == "" and info.origin == "conversation"
    state = await manager.begin(info.session_id, BeginTurn(tenant="acme"))
    turn = AppendTurn(tenant="acme", expected_version=1, lock=state.lock, tokens=[7], model="tiny")
    assert (await manager.append(info.session_id, turn)).model == "tiny"
    state = await manager.begin(info.session_id, BeginTurn(tenant="acme"))
    turn = AppendTurn(tenant="acme", expected_version=2, lock=state.lock, tokens=[8], model="other")
    assert (await manager.append(info.session_id, turn)).model == "tiny"  # set once


@pytest.mark.parametrize("kv_key", ["x" * 32, "é" * 32, "ABC", "0" * 200, "a" * 33])
def test_a_fork_shares_only_a_session_key(kv_key: str) -> None:
    """A fork's KV tag is a session key: 32 hex digits, so its cache keys always fit the
    sidecar's 150 bytes. Anything else is refused where it enters the manager."""
    with pytest.raises(ValidationError):
        CreateSession(tenant="t", model="m", kind="chat", kv_key=kv_key)
