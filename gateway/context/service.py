"""`/v1/context`: create a session (prefill, optionally generate), list, get, patch, delete."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import Response

from cache_manager.client import ManagerClient
from cache_manager.keys import new_session_id
from cache_manager.protocol import ClaimKey, CreateSession, SessionInfo, UpdateSession
from ctxcache.errors import InvalidRequest
from ctxcache.logs import bind_session
from ctxcache.responses import JSONResponse
from ctxcache.settings import check_ttl
from gateway.completions.service import replay_stream
from gateway.completions.streams import SSEResponse
from gateway.idempotency import REPLAYED, IdempotencyKey, with_session
from gateway.locks import NO_LOCK, Held
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.protocol import ContextCreate, ContextList, ContextObject
from gateway.settings import GatewaySettings
from gateway.shaping import ChunkShaper, chat_completion, session_ref, text_completion
from gateway.tools import check_agent_fields, check_tool_messages, check_tools
from gateway.turn_engine import Generation
from gateway.turn_planning import Turn
from gateway.turns import TurnService

log = logging.getLogger(__name__)


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
        reasoning_history=info.reasoning_history,
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
    ) -> Response:
        """Create a session. With an idempotency key, its id is derived from the key: a
        retry finds what the first attempt created, and answers what it answered (a stream:
        as a stream). A streamed create answers as `/v1/chat/completions` streams, and the
        session exists once its last event is sent."""
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
        if req.stream and req.max_tokens == 0:
            raise InvalidRequest("a streamed create needs max_tokens > 0", param="stream")
        self.check_ttl(req.ttl)
        if req.messages is None and (req.tools or req.tool_choice or req.response_format):
            raise InvalidRequest("tools need a chat context (messages)", param="tools")
        tools = check_tools(body.get("tools"))
        check_agent_fields(body, tools)
        self.turns.reasoning.check(body)
        if req.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            check_tool_messages([], messages)
        if key is None:
            turn = await self._plan(tenant, req, body, new_session_id())
            if req.stream:
                return await self._stream(turn, req, body, None, NO_LOCK)
            return JSONResponse(await self._create(turn, req, None, NO_LOCK))
        session_id = key.session_id()
        claim = await self.manager.claim(
            session_id, ClaimKey(tenant=tenant, idempotency=key.record())
        )
        if claim.replay is not None:
            self.metrics.replayed(tenant)
            if req.stream:
                events = replay_stream(_kind(req), body, claim.replay)
                made = {"x-session-id": claim.replay.session["session_id"]}
                return SSEResponse(events, headers=REPLAYED | made)
            out = with_session(claim.replay.answer, claim.replay.session)
            out["expires_at"] = claim.replay.session["expires_at"]
            return JSONResponse(out, headers=REPLAYED)
        assert claim.lock is not None
        # a create that fails frees its key once the claim's lock is gone (nothing was
        # written), given back in the background: the error answer does not wait for it
        what, ttl = "idempotency claim release", claim.lock_ttl_ms
        held = self.turns.held(session_id, tenant, claim.lock, ttl, what=what, wait=False)
        async with held:
            turn = await self._plan(tenant, req, body, session_id)
            if req.stream:  # from here on, the stream gives the claim back
                return await self._stream(turn, req, body, key, held)
            return JSONResponse(await self._create(turn, req, key, held))

    async def _plan(
        self, tenant: str, req: ContextCreate, body: dict[str, Any], session_id: str
    ) -> Turn:
        """The create's engine request: its prompt (tokenized on a worker) and sampling."""
        return await self.turns.plan_create(
            tenant,
            session_id,
            _kind(req),
            body,
            model=req.model,
            messages=[m.model_dump(exclude_none=True) for m in req.messages or []],
            prompt=req.prompt,
            max_tokens=req.max_tokens,
            priority=self.settings.create_priority,  # (docs/vllm.md, "Scheduling")
        )

    async def _create(
        self, turn: Turn, req: ContextCreate, key: IdempotencyKey | None, claim: Held
    ) -> dict[str, Any]:
        async def finish(gen: Generation) -> dict[str, Any]:
            out = _answer(turn, gen, gen.text if req.max_tokens > 0 else None)
            info = await self._keep(turn, req, gen, out, key, claim)
            out.update(
                session_id=info.session_id, expires_at=info.expires_at, session=session_ref(info)
            )
            return out

        return await self.turns.run(turn, finish, creates=True)

    async def _stream(
        self,
        turn: Turn,
        req: ContextCreate,
        body: dict[str, Any],
        key: IdempotencyKey | None,
        claim: Held,
    ) -> SSEResponse:
        """The create's answer as it is generated; the session is written after its last
        token, before the usage chunk and `[DONE]`. A stream that breaks off (the client
        left, the worker failed) wrote nothing, and an idempotency key is free again."""
        assert turn.session_id is not None
        shaper = ChunkShaper(turn.kind, req.model, bool(body.get("return_token_ids")))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def finish(gen: Generation) -> dict[str, Any]:
            out = _answer(turn, gen, gen.text)
            out.update(id=shaper.id, created=shaper.created)  # a replay is the same stream
            return session_ref(await self._keep(turn, req, gen, out, key, claim))

        headers = {"x-session-id": turn.session_id}
        return await self.turns.stream(
            turn, shaper, include_usage, finish, holds=(claim,), creates=True, headers=headers
        )

    async def _keep(
        self,
        turn: Turn,
        req: ContextCreate,
        gen: Generation,
        out: dict[str, Any],
        key: IdempotencyKey | None,
        claim: Held,
    ) -> SessionInfo:
        """Write the session: the prompt and what was generated (one write; it takes the
        claim's lock)."""
        assert gen.worker is not None and turn.session_id is not None
        messages = turn.new_messages
        if req.max_tokens > 0 and turn.kind == "chat":
            messages = [*messages, gen.assistant()]
        info = await self.manager.create(
            CreateSession(
                session_id=turn.session_id,
                tenant=turn.tenant,
                model=req.model,
                kind=turn.kind,
                tokens=turn.prompt + gen.token_ids,
                messages=messages,
                tools=turn.tools,
                ttl=self.check_ttl(req.ttl),
                metadata=req.metadata or {},
                reasoning_history=req.reasoning_history,
                worker=gen.worker.id,
                sidecar=gen.worker.sidecar,
                idempotency=key.record(out) if key is not None else None,
                lock=claim.lock,
            )
        )
        claim.done()
        self.metrics.sessions_created.inc()
        if turn.kind == "chat":
            self.turns.remember(turn.session_id, info.version, messages, info.expires_at)
        with bind_session(turn.session_id):
            log.info("created: %d tokens, %d generated", len(turn.prompt), len(gen.token_ids))
        return info

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
        self.turns.forget(session_id)
        self.metrics.sessions_deleted.inc()


def _answer(turn: Turn, gen: Generation, text: str | None) -> dict[str, Any]:
    """The create's answer object (`text` None: prefill only, `choices: []`)."""
    if turn.kind == "chat":
        return chat_completion(
            turn.model, text, gen.finish_reason, gen.usage, gen.message, gen.logprobs
        )
    return text_completion(turn.model, text, gen.finish_reason, gen.usage)


def _kind(req: ContextCreate) -> str:
    """The session's kind: "chat" (messages) or "completion" (a prompt)."""
    return "chat" if req.messages is not None else "completion"
