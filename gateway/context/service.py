"""`/v1/context`: create a session (prefill, optionally generate), list, get, patch, delete."""

from __future__ import annotations

import time
from typing import Any

from cache_manager.client import ManagerClient
from cache_manager.protocol import ClaimKey, CreateSession, SessionInfo, UpdateSession
from cache_manager.store import new_session_id
from ctxcache.errors import InvalidRequest
from ctxcache.settings import check_ttl
from gateway.idempotency import IdempotencyKey, with_session
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.protocol import ContextCreate, ContextList, ContextObject
from gateway.settings import GatewaySettings
from gateway.shaping import chat_completion, sampling_fields, session_ref, text_completion
from gateway.turns import Turn, TurnService

CREATE_ONLY = ("ttl", "metadata")


def context_object(info: SessionInfo) -> ContextObject:
    return ContextObject(
        session_id=info.session_id,
        model=info.model,
        created=info.created,
        expires_at=info.expires_at,
        ttl=info.ttl,
        context_tokens=info.context_tokens,
        turns=info.turns,
        metadata=info.metadata,
        kv_tokens=info.kv_tokens,
        kv_bytes=info.kv_bytes,
    )


class ContextService:
    def __init__(
        self,
        manager: ManagerClient,
        turns: TurnService,
        pool: WorkerPool,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
    ) -> None:
        self.manager = manager
        self.turns = turns
        self.pool = pool
        self.settings = settings
        self.metrics = metrics

    def check_ttl(self, ttl: int | None) -> int:
        s = self.settings
        return check_ttl(ttl, default=s.default_ttl, low=s.min_ttl, high=s.max_ttl)

    async def create(
        self,
        tenant: str,
        req: ContextCreate,
        body: dict[str, Any],
        key: IdempotencyKey | None = None,
    ) -> dict[str, Any]:
        """Create a session. With an idempotency key, its id is derived from the key: a
        retry finds what the first attempt created, and answers what it answered."""
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
        self.check_ttl(req.ttl)
        if key is None:
            return await self._create(tenant, req, body, new_session_id(), None, None)
        session_id = key.session_id()
        claim = await self.manager.claim(
            session_id, ClaimKey(tenant=tenant, idempotency=key.record())
        )
        if claim.replay is not None:
            self.metrics.replayed(tenant)
            out = with_session(claim.replay.answer, claim.replay.session)
            out["expires_at"] = claim.replay.session["expires_at"]
            return out
        assert claim.lock is not None
        keeper = self.turns.keeper
        keeper.keep(session_id, tenant, claim.lock, claim.lock_ttl_ms)
        try:
            return await self._create(tenant, req, body, session_id, key, claim.lock)
        except BaseException:
            keeper.stop(claim.lock)
            # the key is free again once its lock is gone (nothing was written)
            self.turns.background.spawn(
                self.manager.release(session_id, tenant, claim.lock),
                what="idempotency claim release",
                session_id=session_id,
            )
            raise
        finally:
            keeper.stop(claim.lock)

    async def _create(
        self,
        tenant: str,
        req: ContextCreate,
        body: dict[str, Any],
        session_id: str,
        key: IdempotencyKey | None,
        lock: str | None,
    ) -> dict[str, Any]:
        started = time.perf_counter()
        ttl = self.check_ttl(req.ttl)
        generate = req.max_tokens > 0
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        kind = "chat" if req.messages is not None else "completion"

        async def build(worker: Worker) -> tuple[list[int], int]:
            if kind == "chat":  # prefill only: the conversation so far, closed
                return await self.turns.prompts.chat(
                    worker, req.model, messages, generation_prompt=generate
                )
            assert req.prompt is not None
            return await self.turns.prompts.text(worker, req.model, req.prompt, special=True)

        (prompt, window), worker = await self.turns.failover(req.model, build)
        sampling = {k: v for k, v in sampling_fields(body).items() if k not in CREATE_ONLY}
        sampling["max_tokens"] = req.max_tokens  # the worker's own default is not ours (0)
        turn = Turn(
            kind=kind,
            model=req.model,
            tenant=tenant,
            prompt=prompt,
            new_tokens=prompt,
            new_messages=messages,
            history=[],
            window=window,
            session_id=session_id,
            worker=worker,
            sampling=sampling,
            started=started,
            priority=self.settings.create_priority,  # (docs/vllm.md, "Scheduling")
        )
        self.turns.check_window(turn)
        gen = await self.turns.generate(turn)
        assert turn.worker is not None
        if generate and kind == "chat":
            messages = [*messages, {"role": "assistant", "content": gen.text}]
        text = gen.text if generate else None
        if kind == "chat":
            out = chat_completion(req.model, text, gen.finish_reason, gen.usage)
        else:
            out = text_completion(req.model, text, gen.finish_reason, gen.usage)
        info = await self.manager.create(
            CreateSession(
                session_id=session_id,
                tenant=tenant,
                model=req.model,
                kind=kind,
                tokens=prompt + gen.token_ids,
                messages=messages,
                ttl=ttl,
                metadata=req.metadata or {},
                worker=turn.worker.id,
                sidecar=turn.worker.sidecar,
                idempotency=key.record(out) if key is not None else None,
                lock=lock,
            )
        )
        self.metrics.sessions_created.inc()
        if kind == "chat":
            self.turns.recent.put(session_id, info.version, messages, info.expires_at)
        out.update(session_id=session_id, expires_at=info.expires_at, session=session_ref(info))
        return out

    async def list(self, tenant: str, limit: int, after: str | None) -> ContextList:
        page = await self.manager.list(tenant, limit=limit, after=after)
        return ContextList(
            data=[context_object(i) for i in page.data],
            has_more=page.has_more,
            first_id=page.first_id,
            last_id=page.last_id,
        )

    async def get(self, tenant: str, session_id: str) -> ContextObject:
        return context_object(await self.manager.get(session_id, tenant))

    async def update(self, tenant: str, session_id: str, ttl: int) -> ContextObject:
        self.check_ttl(ttl)
        return context_object(
            await self.manager.update(session_id, UpdateSession(tenant=tenant, ttl=ttl))
        )

    async def delete(self, tenant: str, session_id: str) -> None:
        await self.manager.delete(session_id, tenant)
        self.turns.recent.drop(session_id)
        self.metrics.sessions_deleted.inc()
