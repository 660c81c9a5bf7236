"""On a real Redis Cluster (3 masters, `redis-cli --cluster create`): a session's turn writes
only its session's hash slot and its tenant's. Every master reports each key it writes
(keyspace notifications, `notify-keyspace-events KA`), including the writes made inside Lua
scripts, so what a create, a locked turn (begin + the tenant status pipelined with it +
append + the index update after it), a TTL-sliding read-only turn and a status read wrote is
seen key by key. No key that every turn of the fleet would write (one slot for the whole
cluster) may show up; a status read writes nothing at all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from cache_manager.app import create_app
from cache_manager.client import ManagerClient
from cache_manager.keys import session_keys, tenant_keys
from cache_manager.protocol import AppendTurn, BeginTurn, CreateSession
from cache_manager.settings import ManagerSettings
from ctxcache.redis_topologies import RedisClusterServers
from tests.cache_manager.conftest import FakeSidecarLink

CHANNEL = "__keyspace@0__:"
# Redis' own deletions of keys whose time ran out are not writes of ours
NOT_OURS = {"expired", "evicted"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(tmp_path_factory.mktemp("slots"), masters=3, replicas=0)
    try:
        yield servers.start()
    finally:
        servers.stop()


@dataclass
class Writes:
    """(key, event) for every key a master reported written while it was open."""

    seen: list[tuple[str, str]] = field(default_factory=list)

    @property
    def keys(self) -> set[str]:
        return {key for key, _ in self.seen}


@contextlib.asynccontextmanager
async def key_writes(cluster: RedisClusterServers) -> AsyncIterator[Writes]:
    writes = Writes()
    clients, subs = [], []
    for node in cluster.masters():
        client = aioredis.Redis(port=node.port)
        await client.config_set("notify-keyspace-events", "KA")
        sub = client.pubsub()
        await sub.psubscribe(CHANNEL + "*")
        while (await sub.get_message(timeout=1.0)) is None:  # the psubscribe confirmation
            pass
        clients.append(client)
        subs.append(sub)
    try:
        yield writes
        for sub in subs:  # a notification is sent before the command's reply: all are here
            while msg := await sub.get_message(ignore_subscribe_messages=True, timeout=0.3):
                event = msg["data"].decode()
                if event not in NOT_OURS:
                    writes.seen.append((msg["channel"].decode()[len(CHANNEL) :], event))
    finally:
        for sub in subs:
            await sub.aclose()
        for client in clients:
            await client.aclose()


@contextlib.asynccontextmanager
async def manager_on(cluster: RedisClusterServers) -> AsyncIterator[ManagerClient]:
    settings = ManagerSettings(redis_url=cluster.url, min_ttl=1)
    app = create_app(settings, sidecar_link=FakeSidecarLink())
    async with ManagerClient.in_process(app) as manager:
        yield manager


def slot(key: str) -> int:
    return key_slot(key.encode())


async def test_a_turn_writes_only_its_sessions_and_its_tenants_slots(
    cluster: RedisClusterServers,
) -> None:
    async with manager_on(cluster) as manager:
        # other tenants' sessions, and some of this tenant's about to expire (the next
        # index write purges them, in the tenant's slot)
        for tenant in ("slots-a", "slots-b", "slots-c"):
            for ttl in (1, 1, 600):
                await manager.create(
                    CreateSession(tenant=tenant, model="m", kind="completion", tokens=[1], ttl=ttl)
                )
        await asyncio.sleep(1.2)
        async with key_writes(cluster) as writes:
            info = await manager.create(
                CreateSession(
                    tenant="slots-a",
                    model="m",
                    kind="chat",
                    tokens=[1, 2, 3],
                    messages=[{"role": "user", "content": "hi"}],
                    ttl=600,
                )
            )
            sid = info.session_id
            version = info.version
            for turn in range(3):  # the first begin reads the tenant's usage, the later not
                if turn == 2:
                    manager.service._totals.clear()
                state = await manager.begin(sid, BeginTurn(tenant="slots-a", messages=True))
                info = await manager.append(
                    sid,
                    AppendTurn(
                        tenant="slots-a",
                        expected_version=version,
                        lock=state.lock,
                        tokens=[4, 5],
                        messages=[{"role": "assistant", "content": "yes"}],
                    ),
                )
                version = info.version
                await manager.service.drain()
            # a read-only turn (`session_append: false`) slides the TTL, takes no lock
            await manager.begin(sid, BeginTurn(tenant="slots-a", lock=False, touch=True))
            await manager.service.drain()
    allowed = {slot(session_keys(sid)[0]), slot(tenant_keys("slots-a")[0])}
    outside = sorted(k for k in writes.keys if slot(k) not in allowed)
    assert outside == [], f"written outside the session's and the tenant's slots: {outside}"
    # it did write both slots (this check sees writes)
    assert set(session_keys(sid)[:3]) <= writes.keys
    assert tenant_keys("slots-a")[0] in writes.keys
    # the expired sessions were purged by the tenant's own index write
    assert ("tn:{slots-a}:exp", "zrem") in writes.seen


async def test_a_status_read_and_the_live_count_write_nothing(
    cluster: RedisClusterServers,
) -> None:
    async with manager_on(cluster) as manager:
        base = await manager.live_sessions()
        for tenant in ("status-a", "status-b"):
            for ttl in (1, 600):
                await manager.create(
                    CreateSession(tenant=tenant, model="m", kind="completion", tokens=[7], ttl=ttl)
                )
        await asyncio.sleep(1.2)  # one session of each tenant expired, not purged yet
        async with key_writes(cluster) as writes:
            usage = await manager.usage("status-a")
            live = await manager.live_sessions()
        assert writes.seen == []
        # the unpurged expired ids are not counted
        assert (usage.sessions, usage.context_tokens) == (1, 1)
        assert live == base + 2
        # and the next write of the tenant's index purges them
        async with key_writes(cluster) as writes:
            await manager.create(
                CreateSession(tenant="status-a", model="m", kind="completion", tokens=[7])
            )
        assert ("tn:{status-a}:exp", "zrem") in writes.seen
        assert (await manager.usage("status-a")).sessions == 2
