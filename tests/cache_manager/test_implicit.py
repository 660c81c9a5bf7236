"""Implicit sessions in the manager (docs/implicit.md): their states found by digest in one
round trip, their quota given way to explicit sessions (however many creates race for it),
and their KV never pinned."""

from __future__ import annotations

import asyncio

import pytest

from cache_manager.client import ManagerClient
from cache_manager.protocol import (
    CreateSession,
    FindImplicit,
    ImplicitMark,
    ImplicitPoint,
    MarkPrefixes,
    SharedPrefix,
)
from ctxcache.errors import QuotaExceeded
from tests.cache_manager.conftest import FakeSidecarLink, ManagerFactory

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def implicit(tenant: str, digest: str, **kw: object) -> CreateSession:
    return CreateSession(
        tenant=tenant,
        model="tiny",
        kind="chat",
        tokens=[1, 2, 3],
        messages=MSGS,
        origin="implicit",
        sidecar="http://sidecar",
        implicit=ImplicitMark(digest=digest, messages=2, ttl=60),
        **kw,
    )  # type: ignore[arg-type]


async def test_a_state_is_found_by_its_digest_and_only_by_its_tenant(
    manager: ManagerClient, sidecar_link: FakeSidecarLink
) -> None:
    info = await manager.create(implicit("acme", "a" * 32))
    got = await manager.find_implicit(FindImplicit(tenant="acme", digests=["b" * 32, "a" * 32]))
    assert got.index == 1 and got.point == ImplicitPoint(
        session_id=info.session_id, version=1, tokens=3, messages=2
    )
    other = await manager.find_implicit(FindImplicit(tenant="other", digests=["a" * 32]))
    assert (other.index, other.point) == (-1, None)
    assert not [c for c in sidecar_link.calls if c[0] == "pin"]  # (their KV goes first)


async def test_a_shared_prefix_names_a_point_inside_a_session(manager: ManagerClient) -> None:
    info = await manager.create(implicit("acme", "c" * 32))
    point = ImplicitPoint(session_id=info.session_id, version=1, tokens=2, messages=1)
    prefix = SharedPrefix(digest="d" * 32, point=point, ttl=60)
    await manager.mark_prefixes(MarkPrefixes(tenant="acme", prefixes=[prefix]))
    got = await manager.find_implicit(FindImplicit(tenant="acme", digests=["d" * 32]))
    assert got.point == point
    usage = await manager.usage("acme")
    assert usage.implicit_sessions == 1  # (a prefix is no session of its own)


async def test_racing_creates_at_the_quota_evict_implicit_sessions_never_explicit(
    make_manager: ManagerFactory,
) -> None:
    quotas = {"full": {"max_sessions": 8, "max_context_tokens": 10_000}}
    async with make_manager(tenant_quotas=quotas) as manager:
        explicit = await manager.create(
            CreateSession(tenant="full", model="tiny", kind="chat", messages=MSGS)
        )
        for i in range(7):
            await manager.create(implicit("full", f"{i:032x}"))
        explicit_create = CreateSession(tenant="full", model="tiny", kind="chat", messages=MSGS)
        made = await asyncio.gather(*(manager.create(explicit_create) for _ in range(7)))
        assert len({m.session_id for m in made}) == 7  # every one found room
        listed = {s.session_id for s in (await manager.list("full", limit=100)).data}
        assert listed == {explicit.session_id, *(m.session_id for m in made)}
        usage = await manager.usage("full")
        assert (usage.sessions, usage.implicit_sessions) == (8, 0)
        with pytest.raises(QuotaExceeded):  # nothing implicit is left to give way
            await manager.create(implicit("full", "e" * 32))
