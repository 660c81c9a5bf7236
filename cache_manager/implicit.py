"""The implicit sessions' index (docs/implicit.md): which conversation state a digest names,
and which of a tenant's implicit sessions was used least recently.

    im:{<tenant>}:<digest>  string  JSON `ImplicitPoint`: the session, version, token and
                                    message counts of the state (PX: the state's idle TTL)
    tn:{<tenant>}:imp       zset    the tenant's implicit session ids by when their latest
                                    state expires (ms): the order they give way in when the
                                    tenant's quota is full (the least recently used first)

Both are in the tenant's slot (its `{...}` hash tag), so one MGET finds the longest of a
request's states on one Redis, on Sentinel and on a Redis Cluster. A point is only a hint:
the session's own record is the truth, and a point whose session is gone, or that the
session no longer holds, is a miss (`ImplicitPoint.version` and its counts are checked
against the session when it is loaded).
"""

from __future__ import annotations

import time

import orjson

from cache_manager.protocol import ImplicitPoint
from cache_manager.redis_url import StoreRedis
from cache_manager.store_errors import redis_errors

POPS = 64  # expired ids skipped, at most, looking for a live one to evict


def point_key(tenant: str, digest: str) -> str:
    return f"im:{{{tenant}}}:{digest}"


def lru_key(tenant: str) -> str:
    return f"tn:{{{tenant}}}:imp"


class ImplicitIndex:
    """One round trip per method."""

    def __init__(self, redis: StoreRedis) -> None:
        self.redis = redis

    async def find(self, tenant: str, digests: list[str]) -> tuple[int, ImplicitPoint] | None:
        """The first of `digests` (longest conversation first) that names a state."""
        async with redis_errors():
            found = await self.redis.mget([point_key(tenant, d) for d in digests])
        for index, raw in enumerate(found):
            if raw is not None:
                return index, ImplicitPoint.model_validate_json(raw)
        return None

    async def mark(
        self, tenant: str, digest: str, point: ImplicitPoint, ttl_s: int, *, evictable: bool
    ) -> None:
        """Name the state `point` by `digest` for `ttl_s`. An `evictable` session (an
        implicit one: not a stored response's) is used now, in the order they give way in
        (which forgets the sessions whose states have all expired)."""
        now_ms = int(time.time() * 1000)
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(point_key(tenant, digest), orjson.dumps(point.model_dump()), px=ttl_s * 1000)
            if evictable:
                pipe.zadd(lru_key(tenant), {point.session_id: now_ms + ttl_s * 1000})
                pipe.zremrangebyscore(lru_key(tenant), 0, now_ms)
            await pipe.execute()

    async def pop_least_used(self, tenant: str) -> str | None:
        """Take the tenant's least recently used live implicit session out of the order
        (the caller evicts it): each evictor gets another, however many run at once."""
        now_ms = int(time.time() * 1000)
        for _ in range(POPS):
            async with redis_errors():
                popped = await self.redis.zpopmin(lru_key(tenant))
            if not popped:
                return None
            session_id, expires_ms = popped[0]
            if expires_ms >= now_ms:
                return session_id.decode()  # (else: expired, only its place was left)
        return None

    async def live(self, tenant: str) -> int:
        """How many of the tenant's sessions are implicit (and could give way)."""
        now_ms = int(time.time() * 1000)
        async with redis_errors():
            return int(await self.redis.zcount(lru_key(tenant), now_ms, "+inf"))

    async def forget(self, tenant: str, session_id: str) -> None:
        """The session is gone (evicted, deleted, expired): no longer a candidate. Its points
        run out on their own (a point of a missing session is a miss)."""
        async with redis_errors():
            await self.redis.zrem(lru_key(tenant), session_id)
