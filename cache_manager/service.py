"""Session operations: TTL bounds, quotas, the turn lock and KV pins around the store."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import orjson

from cache_manager.implicit import ImplicitIndex
from cache_manager.keys import new_session_id, valid_session_id
from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    Claim,
    ClaimKey,
    CreateSession,
    EditItems,
    FindImplicit,
    ImplicitFound,
    ImplicitMark,
    ImplicitPoint,
    ItemsEdited,
    MarkPrefixes,
    Replay,
    ResponseDeleted,
    ResponseRecord,
    SessionInfo,
    SessionList,
    SessionState,
    TenantUsage,
    UpdateSession,
)
from cache_manager.records import parse_info
from cache_manager.settings import ManagerSettings
from cache_manager.sidecar_link import BackgroundLink
from cache_manager.store import SessionStore
from ctxcache.errors import InvalidRequest, QuotaExceeded, SessionNotFound, StoreUnavailable
from ctxcache.lmcache_keys import session_key
from ctxcache.logs import bind_session
from ctxcache.settings import check_ttl

log = logging.getLogger(__name__)


TOTAL_FRESH_S = 2.0  # how long a tenant's known token total stands in for a Redis read
RELEASE_AFTER_STALL_S = 5.0  # how long a lock taken by a timed-out begin is looked for
EVICTIONS_PER_CREATE = 4  # implicit sessions a create over the quota may evict, at most


class SessionService:
    def __init__(self, store: SessionStore, settings: ManagerSettings, link: BackgroundLink):
        self.store = store
        self.settings = settings
        self.link = link
        self.implicit = ImplicitIndex(store.redis)
        # tenant -> (total context tokens, when learned): every index write returns it, so
        # a busy tenant's quota pre-check costs no extra Redis read
        self._totals: dict[str, tuple[int, float]] = {}
        self.background = link.background

    def _learn(self, tenant: str, total: int) -> None:
        self._totals[tenant] = (total, time.monotonic())

    def _known_total(self, tenant: str) -> int | None:
        known = self._totals.get(tenant)
        if known is None or time.monotonic() - known[1] > TOTAL_FRESH_S:
            return None
        return known[0]

    def _index_later(self, info: SessionInfo) -> None:
        """Record the turn in the tenant index after answering: the CAS append already made
        it durable, and the index write is versioned, so order does not matter."""

        async def record() -> None:
            self._learn(info.tenant, await self.store.record(info))

        self.background.spawn(
            record(),
            what="tenant index update (the next turn catches up)",
            session_id=info.session_id,
        )

    async def drain(self) -> None:
        """Wait for background index writes and sidecar calls (tests, shutdown)."""
        await self.background.drain()

    def check_ttl(self, ttl: int | None) -> int:
        s = self.settings
        return check_ttl(ttl, default=s.default_ttl, low=s.min_ttl, high=s.max_ttl)

    @staticmethod
    def _check_id(session_id: str) -> None:
        # Anything not shaped like our ids cannot exist: no Redis call, same answer.
        if not valid_session_id(session_id):
            raise SessionNotFound()

    async def create(self, req: CreateSession) -> SessionInfo:
        ttl = self.check_ttl(req.ttl)
        session_id = req.session_id or new_session_id()
        if not valid_session_id(session_id):
            raise InvalidRequest("malformed session_id", param="session_id")
        exp_ms = await self._reserve(req, session_id, ttl)
        now_ms = req.created_ms or int(time.time() * 1000)
        fields: dict[str, Any] = {
            "tenant": req.tenant,
            "model": req.model,
            "kind": req.kind,
            "created": now_ms,
            "last_used": now_ms,
            "ttl": ttl,
            "expires_at": exp_ms,
            "turns": 1 if req.tokens or req.messages else 0,
            "version": 1,
            "context_tokens": len(req.tokens),
            "affinity": req.worker or "",
            "sidecar": req.sidecar or "",
            "metadata": orjson.dumps(req.metadata),
            "origin": req.origin,
            "kv_key": req.kv_key or session_key(session_id),
        }
        if req.tools is not None:
            fields["tools"] = orjson.dumps(req.tools)
        if req.reasoning_history != "template":  # (the default: not written)
            fields["reasoning_history"] = req.reasoning_history
        response = (req.response.id, req.response.record) if req.response else None
        try:
            created = await self.store.create(
                session_id,
                fields,
                exp_ms,
                req.tokens,
                req.messages,
                response,
                idempotency=req.idempotency,
                lock=req.lock,
            )
        except BaseException:
            await self.store.unindex(req.tenant, session_id)
            raise
        if not created:
            await self.store.unindex(req.tenant, session_id)
            raise InvalidRequest("session_id already exists", param="session_id")
        with bind_session(session_id):
            log.info("created %s session, %d tokens, ttl %ds", req.kind, len(req.tokens), ttl)
        if req.origin != "implicit":  # (an implicit session's KV is not pinned: it goes first)
            self.link.pin(req.sidecar, fields["kv_key"], -(-exp_ms // 1000))
        # the record as written: no need to read it back
        info = parse_info(
            session_id,
            {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()},
        )
        if req.implicit is not None:
            await self._mark(info, req.implicit)
        return info

    async def _reserve(self, req: CreateSession, session_id: str, ttl: int) -> int:
        """Count the new session against the tenant's quota (its expires_at ms). A quota
        with no room makes room by evicting the tenant's least recently used implicit
        sessions, which give way before any explicit one (docs/implicit.md)."""
        quota = self.settings.quota_for(req.tenant)
        for evicted in range(EVICTIONS_PER_CREATE + 1):
            try:
                return await self.store.reserve(
                    req.tenant,
                    session_id,
                    ttl=ttl,
                    tokens=len(req.tokens),
                    max_sessions=quota.max_sessions,
                    max_tokens=quota.max_context_tokens,
                )
            except QuotaExceeded:
                if evicted == EVICTIONS_PER_CREATE or not await self._evict_implicit(req.tenant):
                    raise
        raise AssertionError("unreachable")

    async def _evict_implicit(self, tenant: str) -> bool:
        """Delete the tenant's least recently used implicit session; False: it has none."""
        for _ in range(EVICTIONS_PER_CREATE):
            session_id = await self.implicit.pop_least_used(tenant)
            if session_id is None:
                return False
            try:
                await self.delete(session_id, tenant)
            except SessionNotFound:  # (gone meanwhile: another)
                continue
            with bind_session(session_id):
                log.info("implicit session evicted: the tenant's quota is full")
            return True
        return False

    async def _mark(self, info: SessionInfo, mark: ImplicitMark) -> None:
        """Name an implicit session's new state by its digest (docs/implicit.md)."""
        point = ImplicitPoint(
            session_id=info.session_id,
            version=info.version,
            tokens=info.context_tokens,
            messages=mark.messages,
        )
        evictable = info.origin == "implicit"
        await self.implicit.mark(info.tenant, mark.digest, point, mark.ttl, evictable=evictable)

    async def mark_prefixes(self, req: MarkPrefixes) -> None:
        """Name shared prefixes' states (docs/implicit.md, "Shared prefixes")."""
        for prefix in req.prefixes:
            await self.implicit.mark(
                req.tenant, prefix.digest, prefix.point, prefix.ttl, evictable=False
            )

    async def find_implicit(self, req: FindImplicit) -> ImplicitFound:
        """The longest of a request's conversation states the tenant has (one round trip)."""
        found = await self.implicit.find(req.tenant, req.digests)
        if found is None:
            return ImplicitFound()
        return ImplicitFound(index=found[0], point=found[1])

    async def get(self, session_id: str, tenant: str) -> SessionInfo:
        """The session's metadata, with what its sidecar holds of its KV (`kv_*`)."""
        self._check_id(session_id)
        info = await self.store.get(session_id, tenant)
        if info.sidecar:
            held = await self.link.link.held(info.sidecar, info.kv_key)
            if held is not None:
                info.kv_tokens, info.kv_bytes = held
        return info

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        """Load a session for a turn; with `lock`, take the turn lock (409 if taken)."""
        self._check_id(session_id)
        lock = secrets.token_urlsafe(16) if req.lock else None
        known = self._known_total(req.tenant) if req.lock else None
        try:
            loaded = await self.store.begin(
                session_id,
                req.tenant,
                lock=lock,
                lock_ttl_ms=self.settings.lock_ttl_ms,
                tokens=req.tokens,
                messages=req.messages,
                touch=req.touch,
                usage=req.lock and known is None,
                known_version=req.known_version,
                idempotency=req.idempotency,
            )
        except StoreUnavailable:
            if lock is not None:
                self._release_later(session_id, lock)
            raise
        if isinstance(loaded, Replay):  # the key's first attempt wrote: nothing taken
            with bind_session(session_id):
                log.info("idempotent replay of a turn")
            info = await self.store.get(session_id, req.tenant)
            return SessionState.model_construct(
                info=info, tokens=[], messages=[], lock=None, lock_ttl_ms=None, replay=loaded
            )
        info, tokens, messages, usage = loaded
        if usage is not None:
            self._learn(req.tenant, usage[1])
        total = usage[1] if usage is not None else (known or 0)
        if req.lock and total >= self.settings.quota_for(req.tenant).max_context_tokens:
            assert lock is not None
            await self.store.release(session_id, lock)
            raise QuotaExceeded.tokens()
        if req.touch:
            self._learn(info.tenant, await self.store.record(info))
            self.link.pin(info.sidecar, info.kv_key, info.expires_at, ttl=info.ttl)
        # built from what the store returned: nothing to validate again
        return SessionState.model_construct(
            info=info,
            tokens=tokens,
            messages=messages,
            lock=lock,
            lock_ttl_ms=self.settings.lock_ttl_ms if lock else None,
            replay=None,
        )

    async def claim(self, session_id: str, req: ClaimKey) -> Claim:
        """Claim an idempotency key for a create of `session_id` (derived from the key by
        the gateway): the lock marks the attempt running until the create releases it (or
        it runs out: the attempt died, and the key is free again)."""
        if not valid_session_id(session_id):
            raise InvalidRequest("malformed session_id", param="session_id")
        lock = secrets.token_urlsafe(16)
        ttl = self.settings.lock_ttl_ms
        try:
            replay = await self.store.claim(session_id, req.idempotency, lock=lock, lock_ttl_ms=ttl)
        except StoreUnavailable:
            self._release_later(session_id, lock)
            raise
        if replay is not None:
            with bind_session(session_id):
                log.info("idempotent replay of a create")
            return Claim(replay=replay)
        return Claim(lock=lock, lock_ttl_ms=ttl)

    async def items(self, session_id: str, req: EditItems) -> ItemsEdited:
        """A conversation's items: messages added or one deleted (docs/responses.md)."""
        self._check_id(session_id)
        if (req.add is None) == (req.delete is None):
            raise InvalidRequest("give exactly one of add or delete")
        done = await self.store.items(
            session_id,
            req.tenant,
            add=req.add,
            delete=req.delete,
            expected_version=req.expected_version,
            idempotency=req.idempotency,
        )
        if isinstance(done, Replay):
            return ItemsEdited(replay=done)
        self._index_later(done)
        with bind_session(session_id):
            log.info("conversation items edited: version %d", done.version)
        return ItemsEdited(info=done)

    async def renew(self, session_id: str, tenant: str, lock: str) -> bool:
        """Extend a lock we hold by the lock TTL (a turn longer than it renews it)."""
        self._check_id(session_id)
        return await self.store.renew(session_id, lock, self.settings.lock_ttl_ms)

    def _release_later(self, session_id: str, lock: str) -> None:
        """A begin that timed out on a stalled Redis still takes the lock when Redis
        resumes, for a caller who got a 503 and left; a turn whose append or release
        failed while its master failed over left its lock on the replica that takes over.
        Give our token back (release only deletes a lock holding it) until that works,
        rather than leave the session `session_busy` for the lock's whole TTL."""

        async def release() -> None:
            deadline = time.monotonic() + self.settings.lock_ttl_ms / 1000
            answered_at: float | None = None
            while time.monotonic() < deadline:
                try:
                    if await self.store.release(session_id, lock):
                        return
                    answered_at = answered_at or time.monotonic()
                    if time.monotonic() - answered_at > RELEASE_AFTER_STALL_S:
                        return  # the begin never ran: there is no lock to give back
                except StoreUnavailable:
                    pass
                await asyncio.sleep(0.25)

        self.background.spawn(
            release(), what="turn lock release after a store error", session_id=session_id
        )

    async def append(self, session_id: str, req: AppendTurn) -> SessionInfo:
        self._check_id(session_id)
        try:
            info, moved_from = await self.store.append(
                session_id,
                req.tenant,
                expected_version=req.expected_version,
                lock=req.lock,
                tokens=req.tokens,
                messages=req.messages,
                worker=req.worker,
                sidecar=req.sidecar,
                model=req.model,
                response=(req.response.id, req.response.record) if req.response else None,
                idempotency=req.idempotency,
                tools=req.tools,
                replace=req.replace,
            )
        except StoreUnavailable:
            if req.lock is not None:  # appended or not, the session must not stay busy
                self._release_later(session_id, req.lock)
            raise
        self._index_later(info)
        with bind_session(session_id):
            log.debug("turn %d appended, %d tokens", info.turns, info.context_tokens)
        if moved_from and not self._shares_kv(info):
            self.link.drop(moved_from, info.kv_key)
        if info.origin != "implicit":
            self.link.pin(info.sidecar, info.kv_key, info.expires_at, ttl=info.ttl)
        if req.implicit is not None:
            await self._mark(info, req.implicit)
        return info

    @staticmethod
    def _shares_kv(info: SessionInfo) -> bool:
        """Whether other sessions read this one's KV blocks (a fork and its parent): then
        neither drops them; the pin runs out after the family's last turn."""
        return info.kv_shared or info.kv_key != session_key(info.session_id)

    async def release(
        self, session_id: str, tenant: str, lock: str, *, record: str | None = None
    ) -> None:
        """Give a lock back; with `record`, a claim's: its key's record goes too unless it
        holds an answer."""
        self._check_id(session_id)
        try:
            try:
                await self.store.get(session_id, tenant)  # tenant check
            except SessionNotFound:
                # a create's idempotency claim locks a session not made yet: the token (128
                # random bits) is all there is to check
                if not await self.store.release(session_id, lock, record=record):
                    raise
                return
            await self.store.release(session_id, lock, record=record)
        except StoreUnavailable:
            # a failover, at the tenant check or the release: once there is a master (the
            # token is all `_release_later` checks, as above)
            self._release_later(session_id, lock)
            raise

    async def update(self, session_id: str, req: UpdateSession) -> SessionInfo:
        self._check_id(session_id)
        ttl = None if req.ttl is None else self.check_ttl(req.ttl)
        old_sidecar = None
        if req.worker is not None:
            old_sidecar = (await self.store.get(session_id, req.tenant)).sidecar
        info = await self.store.update(
            session_id,
            req.tenant,
            ttl=ttl,
            worker=req.worker,
            sidecar=req.sidecar,
            metadata=req.metadata,
            kv_shared=req.kv_shared,
        )
        if ttl is not None:
            await self.store.record(info, exact_expiry=True)
        if old_sidecar and old_sidecar != info.sidecar and not self._shares_kv(info):
            self.link.drop(old_sidecar, info.kv_key)
        if ttl is not None or req.worker is not None:
            self.link.pin(info.sidecar, info.kv_key, info.expires_at)
        return info

    async def delete(self, session_id: str, tenant: str) -> None:
        self._check_id(session_id)
        info = await self.store.delete(session_id, tenant)
        await self.store.unindex(tenant, session_id)
        if info.origin == "implicit":
            await self.implicit.forget(tenant, session_id)
        with bind_session(session_id):
            log.info("deleted")
        if not self._shares_kv(info):
            self.link.drop(info.sidecar, info.kv_key)

    async def get_response(self, session_id: str, tenant: str, response_id: str) -> ResponseRecord:
        self._check_id(session_id)
        found = await self.store.get_response(session_id, tenant, response_id)
        if found is None:
            raise SessionNotFound()
        return ResponseRecord(record=found[0], version=found[1])

    async def delete_response(
        self, session_id: str, tenant: str, response_id: str
    ) -> ResponseDeleted:
        self._check_id(session_id)
        remaining = await self.store.delete_response(session_id, tenant, response_id)
        if remaining is None:
            raise SessionNotFound()
        return ResponseDeleted(remaining=remaining)

    async def list(self, tenant: str, limit: int, after: str | None) -> SessionList:
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be between 1 and 100", param="limit")
        data, has_more = await self.store.list(tenant, limit=limit, after=after)
        return SessionList(
            data=data,
            has_more=has_more,
            first_id=data[0].session_id if data else None,
            last_id=data[-1].session_id if data else None,
        )

    async def live_sessions(self) -> int:
        return await self.store.live_sessions()

    async def usage(self, tenant: str) -> TenantUsage:
        sessions, tokens = await self.store.usage(tenant)
        quota = self.settings.quota_for(tenant)
        return TenantUsage(
            tenant=tenant,
            sessions=sessions,
            context_tokens=tokens,
            max_sessions=quota.max_sessions,
            max_context_tokens=quota.max_context_tokens,
            implicit_sessions=await self.implicit.live(tenant),
        )
