"""`/v1/context`: create a session (prefill, optionally generate), list, get, patch, delete."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
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
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.protocol import ContextCreate, ContextList, ContextObject
from gateway.settings import GatewaySettings
from gateway.shaping import (
    ChunkShaper,
    chat_completion,
    sampling_fields,
    session_ref,
    text_completion,
)
from gateway.tools import check_agent_fields, check_tool_messages, check_tools, uses_chat_engine
from gateway.turn_types import Generation, Turn, check_window
from gateway.turns import TurnService

CREATE_ONLY = ("ttl", "metadata")
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
        if req.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            check_tool_messages([], messages)
        if key is None:
            turn = await self._plan(tenant, req, body, new_session_id())
            if req.stream:
                return await self._stream(turn, req, body, None, None)
            return JSONResponse(await self._create(turn, req, None, None))
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
        lock = claim.lock
        self.turns.keeper.keep(session_id, tenant, lock, claim.lock_ttl_ms)
        streaming = False
        try:
            turn = await self._plan(tenant, req, body, session_id)
            if req.stream:  # from here on, the stream gives the claim back
                response = await self._stream(turn, req, body, key, lock)
                streaming = True
                return response
            return JSONResponse(await self._create(turn, req, key, lock))
        except BaseException:
            self._unclaim(tenant, session_id, lock)
            raise
        finally:
            if not streaming:
                self.turns.keeper.stop(lock)

    def _unclaim(self, tenant: str, session_id: str, lock: str) -> None:
        """A create that failed frees its key once its lock is gone (nothing was written)."""
        self.turns.keeper.stop(lock)
        self.turns.background.spawn(
            self.manager.release(session_id, tenant, lock),
            what="idempotency claim release",
            session_id=session_id,
        )

    async def _plan(
        self, tenant: str, req: ContextCreate, body: dict[str, Any], session_id: str
    ) -> Turn:
        """The create's engine request: its prompt (tokenized on a worker) and sampling."""
        started = time.perf_counter()
        generate = req.max_tokens > 0
        messages = [m.model_dump(exclude_none=True) for m in req.messages or []]
        kind = _kind(req)

        tools = body.get("tools") or None  # rendered into the prefix, kept with the session

        async def build(worker: Worker) -> tuple[list[int], int]:
            if kind == "chat":  # prefill only: the conversation so far, closed
                return await self.turns.prompts.chat(
                    worker, req.model, messages, generation_prompt=generate, tools=tools
                )
            assert req.prompt is not None
            return await self.turns.prompts.text(worker, req.model, req.prompt, special=True)

        (prompt, window), worker = await self.turns.engine.failover(req.model, build)
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
            tools=tools,
            chat_engine=kind == "chat" and generate and uses_chat_engine(body, tools),
        )
        check_window(turn)
        await self.turns.check_quota(tenant, len(prompt))
        return turn

    async def _create(
        self, turn: Turn, req: ContextCreate, key: IdempotencyKey | None, lock: str | None
    ) -> dict[str, Any]:
        gen = await self.turns.generate(turn)
        out = _answer(turn, gen, gen.text if req.max_tokens > 0 else None)
        info = await self._keep(turn, req, gen, out, key, lock)
        out.update(
            session_id=info.session_id, expires_at=info.expires_at, session=session_ref(info)
        )
        return out

    async def _stream(
        self,
        turn: Turn,
        req: ContextCreate,
        body: dict[str, Any],
        key: IdempotencyKey | None,
        lock: str | None,
    ) -> SSEResponse:
        """The create's answer as it is generated; the session is written after its last
        token, before the usage chunk and `[DONE]`. A stream that breaks off (the client
        left, the worker failed) wrote nothing, and an idempotency key is free again."""
        assert turn.session_id is not None
        session_id = turn.session_id
        shaper = ChunkShaper(turn.kind, req.model, bool(body.get("return_token_ids")))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        kept = False

        async def on_done(gen: Generation) -> dict[str, Any]:
            nonlocal kept
            out = _answer(turn, gen, gen.text)
            out.update(id=shaper.id, created=shaper.created)  # a replay is the same stream
            info = await self._keep(turn, req, gen, out, key, lock)
            kept = True
            return session_ref(info)

        upstream = await self.turns.open_stream(turn)
        events = self.turns.stream(turn, upstream, shaper, include_usage, on_done)
        headers = {"x-session-id": session_id}
        if lock is None:
            return SSEResponse(events, upstream.aclose, headers=headers)

        async def claimed() -> AsyncGenerator[bytes, None]:
            try:
                async for event in events:
                    yield event
            finally:
                await events.aclose()
                if kept:
                    self.turns.keeper.stop(lock)
                else:
                    self._unclaim(turn.tenant, session_id, lock)

        async def never_started() -> None:
            self._unclaim(turn.tenant, session_id, lock)
            await upstream.aclose()

        return SSEResponse(claimed(), never_started, headers=headers)

    async def _keep(
        self,
        turn: Turn,
        req: ContextCreate,
        gen: Generation,
        out: dict[str, Any],
        key: IdempotencyKey | None,
        lock: str | None,
    ) -> SessionInfo:
        """Write the session: the prompt and what was generated (one write)."""
        assert turn.worker is not None and turn.session_id is not None
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
                worker=turn.worker.id,
                sidecar=turn.worker.sidecar,
                idempotency=key.record(out) if key is not None else None,
                lock=lock,
            )
        )
        self.metrics.sessions_created.inc()
        if turn.kind == "chat":
            self.turns.recent.put(turn.session_id, info.version, messages, info.expires_at)
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
        self.turns.recent.drop(session_id)
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
