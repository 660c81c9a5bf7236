"""The tenant index (`tn:{<tenant>}:*`, keys.py): a tenant's live sessions and context tokens
for its quota, its listing order, and the live-session count of the whole store. One
script (tenant.lua) over the tenant's slot; a session's own keys are in another slot."""

from __future__ import annotations

import logging
import time

from cache_manager.keys import session_keys, tenant_keys
from cache_manager.protocol import SessionInfo
from cache_manager.records import parse_info
from cache_manager.redis_url import StoreRedis
from cache_manager.scripts import ScriptRunner, load_script
from cache_manager.store_errors import redis_errors
from ctxcache.errors import InvalidRequest, QuotaExceeded

log = logging.getLogger(__name__)

# A removed session id stays out of its tenant's index this long: a turn's index update
# still on its way must not bring it back (it is sent right after the turn's write, with the
# Redis timeout and one retry, so it lands within seconds or not at all).
KEEP_OUT_MS = 10_000
# A listed id whose record is gone is dropped from the index once it is this old (younger:
# maybe a create in progress, which indexes the id first).
INDEX_GRACE_MS = 60_000
# The tenants the live-session count sums over are found by a SCAN of the tenant indexes at
# most this often (tenants this process has seen are counted at once)
TENANT_SCAN_S = 30.0


class TenantIndex:
    """The tenants' indexes in Redis. Every method is one round trip unless it says
    otherwise."""

    def __init__(self, redis: StoreRedis, scripts: ScriptRunner) -> None:
        self.redis = redis
        self._scripts = scripts
        self._tenant = load_script(redis, "tenant")
        # tenants with an index, for the live-session count: seen here, or found by SCAN
        self._tenants: set[str] = set()
        self._tenants_scanned_at = -TENANT_SCAN_S

    async def reserve(
        self,
        tenant: str,
        session_id: str,
        *,
        ttl: int,
        tokens: int,
        max_sessions: int,
        max_tokens: int,
    ) -> int:
        """Count a new session against the tenant's quota; returns its expires_at ms."""
        args = ["reserve", session_id, ttl, tokens, max_sessions, max_tokens]
        self._tenants.add(tenant)
        async with redis_errors():
            res = await self._tenant(keys=tenant_keys(tenant), args=args)
        if res[0] == -1:
            raise QuotaExceeded.sessions(int(res[1]))
        if res[0] == -2:
            raise QuotaExceeded.tokens()
        if res[0] == -3:
            raise InvalidRequest("session_id already exists", param="session_id")
        return int(res[1])

    async def record(self, info: SessionInfo, *, exact_expiry: bool = False) -> int:
        """The tenant index learns the session's new state (one write, in the tenant's
        slot). Returns the tenant's total context tokens."""
        args = [
            "record",
            info.session_id,
            info.expires_at * 1000,
            info.version,
            info.context_tokens,
            int(exact_expiry),
        ]
        self._tenants.add(info.tenant)
        async with redis_errors():
            (res,) = await self._scripts.pipelined((self._tenant, tenant_keys(info.tenant), args))
        return int(res[1])

    async def unindex(self, tenant: str, session_id: str) -> None:
        """Drop the session from the tenant's index. A turn's index update still on its
        way (`record`, racing a DELETE: the session and the index are in different slots)
        is ignored for KEEP_OUT_MS."""
        async with redis_errors():
            await self._scripts.pipelined(
                (self._tenant, tenant_keys(tenant), ["remove", session_id, KEEP_OUT_MS])
            )

    async def _known_tenants(self) -> set[str]:
        """Every tenant with an index: those seen here, and (every TENANT_SCAN_S) those a
        SCAN of the store finds, so sessions made through other managers count too."""
        if time.monotonic() - self._tenants_scanned_at >= TENANT_SCAN_S:
            # on a cluster, redis-py scans every master
            async for key in self.redis.scan_iter(match="tn:{*}:exp", count=10_000, _type="zset"):
                name = key.decode()
                self._tenants.add(name[len("tn:{") : -len("}:exp")])
            self._tenants_scanned_at = time.monotonic()
        return self._tenants

    async def live_sessions(self) -> int:
        """Live sessions of every tenant: each tenant's read-only status, pipelined (on a
        cluster, one round trip to each master). Nothing is written: no key that every
        create or turn would have to write (one slot for the whole fleet) is needed."""
        async with redis_errors():
            tenants = sorted(await self._known_tenants())
            if not tenants:
                return 0
            calls = [(self._tenant, tenant_keys(t), ["status"]) for t in tenants]
            results = await self._scripts.pipelined(*calls)
        return sum(int(res[1]) for res in results)

    async def usage(self, tenant: str) -> tuple[int, int]:
        async with redis_errors():
            res = await self._tenant(keys=tenant_keys(tenant), args=["status"])
        return int(res[1]), int(res[2])

    async def list(
        self, tenant: str, *, limit: int, after: str | None
    ) -> tuple[list[SessionInfo], bool]:
        """Newest first; `after` is the last id of the previous page. Two round trips.

        An indexed id whose record is gone (deleted while a turn's late index update put
        it back, or lost with a failover's last writes) is skipped, and dropped from the
        index once it is older than a create in progress could be.
        """
        new_key = tenant_keys(tenant)[1]
        async with redis_errors():
            await self._tenant(keys=tenant_keys(tenant), args=["purge"])  # drop expired ids
            start = 0
            if after is not None:
                rank = await self.redis.zrevrank(new_key, after)
                if rank is None:
                    return [], False
                start = rank + 1
            page = await self.redis.zrevrange(new_key, start, start + limit, withscores=True)
            ids = [(i.decode(), int(created)) for i, created in page]
            pipe = self.redis.pipeline(transaction=False)
            for sid, _ in ids[:limit]:
                pipe.hgetall(session_keys(sid)[0])
            recs = await pipe.execute()
        out, stale = [], []
        old = int(time.time() * 1000) - INDEX_GRACE_MS
        for (sid, created), rec in zip(ids[:limit], recs, strict=True):
            if rec and rec.get(b"tenant", b"").decode() == tenant:
                out.append(parse_info(sid, rec))
            elif created < old:
                stale.append(sid)
        for sid in stale:
            log.info("dropping %s from the index of tenant %s: its record is gone", sid, tenant)
            await self.unindex(tenant, sid)
        return out, len(ids) > limit
