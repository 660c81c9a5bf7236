"""Session operations: TTL bounds, quotas, the turn lock and KV pins around the store."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import orjson

from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    CreateSession,
    SessionInfo,
    SessionList,
    SessionState,
    TenantUsage,
    UpdateSession,
)
from cache_manager.settings import ManagerSettings
from cache_manager.sidecar_link import BackgroundLink
from cache_manager.store import SessionStore, new_session_id, valid_session_id
from ctxcache.errors import InvalidRequest, QuotaExceeded, SessionNotFound
from ctxcache.logs import bind_session
from ctxcache.settings import check_ttl

log = logging.getLogger(__name__)


class SessionService:
    def __init__(self, store: SessionStore, settings: ManagerSettings, link: BackgroundLink):
        self.store = store
        self.settings = settings
        self.link = link

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
        quota = self.settings.quota_for(req.tenant)
        exp_ms = await self.store.reserve(
            req.tenant,
            session_id,
            ttl=ttl,
            tokens=len(req.tokens),
            max_sessions=quota.max_sessions,
            max_tokens=quota.max_context_tokens,
        )
        now_ms = int(time.time() * 1000)
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
        }
        try:
            created = await self.store.create(session_id, fields, exp_ms, req.tokens, req.messages)
        except BaseException:
            await self.store.unindex(req.tenant, session_id)
            raise
        if not created:
            await self.store.unindex(req.tenant, session_id)
            raise InvalidRequest("session_id already exists", param="session_id")
        with bind_session(session_id):
            log.info("created %s session, %d tokens, ttl %ds", req.kind, len(req.tokens), ttl)
        self.link.pin(req.sidecar, session_id, -(-exp_ms // 1000))
        return await self.store.get(session_id, req.tenant)

    async def get(self, session_id: str, tenant: str) -> SessionInfo:
        self._check_id(session_id)
        return await self.store.get(session_id, tenant)

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        """Load a session for a turn; with `lock`, take the turn lock (409 if taken)."""
        self._check_id(session_id)
        lock = secrets.token_urlsafe(16) if req.lock else None
        info, tokens, messages, (_, total) = await self.store.begin(
            session_id,
            req.tenant,
            lock=lock,
            lock_ttl_ms=self.settings.lock_ttl_ms,
            tokens=req.tokens,
            messages=req.messages,
            touch=req.touch,
        )
        if req.lock and total >= self.settings.quota_for(req.tenant).max_context_tokens:
            assert lock is not None
            await self.store.release(session_id, lock)
            raise QuotaExceeded("tenant context-token quota exhausted")
        if req.touch:
            await self.store.record(info)
            self.link.pin(info.sidecar, session_id, info.expires_at)
        # built from what the store returned: nothing to validate again
        return SessionState.model_construct(info=info, tokens=tokens, messages=messages, lock=lock)

    async def append(self, session_id: str, req: AppendTurn) -> SessionInfo:
        self._check_id(session_id)
        info, moved_from = await self.store.append(
            session_id,
            req.tenant,
            expected_version=req.expected_version,
            lock=req.lock,
            tokens=req.tokens,
            messages=req.messages,
            worker=req.worker,
            sidecar=req.sidecar,
        )
        await self.store.record(info)
        with bind_session(session_id):
            log.debug("turn %d appended, %d tokens", info.turns, info.context_tokens)
        if moved_from:
            self.link.drop(moved_from, session_id)
        self.link.pin(info.sidecar, session_id, info.expires_at)
        return info

    async def release(self, session_id: str, tenant: str, lock: str) -> None:
        self._check_id(session_id)
        await self.store.get(session_id, tenant)  # tenant check
        await self.store.release(session_id, lock)

    async def update(self, session_id: str, req: UpdateSession) -> SessionInfo:
        self._check_id(session_id)
        ttl = None if req.ttl is None else self.check_ttl(req.ttl)
        old_sidecar = None
        if req.worker is not None:
            old_sidecar = (await self.store.get(session_id, req.tenant)).sidecar
        info = await self.store.update(
            session_id, req.tenant, ttl=ttl, worker=req.worker, sidecar=req.sidecar
        )
        if ttl is not None:
            await self.store.record(info, exact_expiry=True)
        if old_sidecar and old_sidecar != info.sidecar:
            self.link.drop(old_sidecar, session_id)
        self.link.pin(info.sidecar, session_id, info.expires_at)
        return info

    async def delete(self, session_id: str, tenant: str) -> None:
        self._check_id(session_id)
        sidecar = await self.store.delete(session_id, tenant)
        await self.store.unindex(tenant, session_id)
        with bind_session(session_id):
            log.info("deleted")
        self.link.drop(sidecar, session_id)

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
        )
