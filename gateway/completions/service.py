"""`/v1/completions` and `/v1/chat/completions`: a pass-through, or a session turn.

`serve` takes every request of the two routes. One with no session and a body that names
a model is only routed (`passthrough`): checked no further, salted with the tenant's
`cache_salt`, sent to the least-loaded healthy worker, its answer passed back as it is (a
stream's bytes as they arrive). Everything else is validated in full (`answer`) and, with a
session, run as a turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from fastapi import Response
from pydantic import BaseModel

from cache_manager.protocol import Replay, SessionInfo
from ctxcache.logs import bind_session
from ctxcache.responses import JSONResponse
from gateway import metering
from gateway.completions.answers import shape
from gateway.completions.streams import SSEResponse, UsageTap, relayed
from gateway.idempotency import REPLAYED, IdempotencyKey, check_header, with_session
from gateway.implicit.fields import NO_FIELDS, CacheFields, engine_bytes
from gateway.implicit.first import FirstRequest
from gateway.implicit.service import ImplicitSessions
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.protocol import ChatBody, CompletionBody
from gateway.requests import parse_body, parse_json, session_id_of
from gateway.salt import CacheSalt
from gateway.shaping import (
    DONE,
    ChunkShaper,
    session_ref,
)
from gateway.tools import passthrough_tool_choice
from gateway.turn_engine import Generation
from gateway.turn_planning import Turn
from gateway.turns import TurnService
from gateway.upstream import failover, open_stream, post_raw, refused_payload

log = logging.getLogger(__name__)


PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
KINDS = {path: kind for kind, path in PATHS.items()}
BODIES: dict[str, type[BaseModel]] = {"chat": ChatBody, "completion": CompletionBody}


class CompletionService:
    def __init__(
        self,
        turns: TurnService,
        pool: WorkerPool,
        salt: CacheSalt,
        metrics: GatewayMetrics,
        *,
        idempotency_ttl_s: int = 86_400,
        implicit: ImplicitSessions | None = None,
    ) -> None:
        self.turns = turns
        self.pool = pool
        self.salt = salt
        self.metrics = metrics
        self.idempotency_ttl_s = idempotency_ttl_s
        self.implicit = implicit

    async def serve(
        self,
        tenant: str,
        kind: str,
        raw: bytes,
        session_header: str | None,
        idempotency_key: list[str] | None = None,
    ) -> Response:
        """A request to one of the two routes, from its raw body (`idempotency_key`: the
        values of its `Idempotency-Key` header, if any)."""
        doc = parse_body(raw)
        if doc is None or session_header is not None or not routable(doc):
            return await self.answer(
                tenant, kind, raw, session_header, parsed=doc, idempotency_key=idempotency_key
            )
        if kind == "chat":  # (thinking asked of a deployment without a parser: refused)
            self.turns.reasoning.check_raw(raw, doc)
        fields = CacheFields.of(doc) if b"prompt_cache" in raw else NO_FIELDS
        if kind == "chat" and self.implicit is not None and self.implicit.take(tenant, doc, fields):

            async def fallback(first: FirstRequest | None) -> Response:
                return await self.passthrough(tenant, kind, raw, doc, first)

            return await self.implicit.serve(tenant, doc, raw, fields, fallback)
        if kind == "chat" and self.implicit is not None:
            self.metrics.implicit("passed")
        return await self.passthrough(tenant, kind, raw, doc)

    async def answer(
        self,
        tenant: str,
        kind: str,
        raw: bytes,
        session_header: str | None,
        *,
        parsed: dict[str, Any] | None = None,
        idempotency_key: list[str] | str | None = None,
    ) -> Response:
        """A completion request from its raw body (`parsed`: the same, already decoded):
        validated, then passed through to a worker, or run as a session turn.
        `idempotency_key`: the
        request's `Idempotency-Key` header value(s); a session turn that appends records
        its answer under it (docs/limits.md), anything else ignores it."""
        body, _ = parse_json(raw, BODIES[kind], parsed)
        sid = session_id_of(body, session_header)
        key = None
        if sid is not None and idempotency_key is not None:
            values = [idempotency_key] if isinstance(idempotency_key, str) else idempotency_key
            key = IdempotencyKey.of(
                check_header(values),
                tenant,
                PATHS[kind],
                raw,
                ttl_s=self.idempotency_ttl_s,
                scope=session_header or "",
            )
        return await self.handle(tenant, kind, raw, body, sid, key)

    async def handle(
        self,
        tenant: str,
        kind: str,
        raw: bytes,
        body: dict[str, Any],
        session_id: str | None,
        key: IdempotencyKey | None = None,
    ) -> Response:
        if session_id is None:
            return await self.passthrough(tenant, kind, raw, body)
        if b"prompt_cache" in raw:
            CacheFields.of(body)  # (checked; a session turn has no use for them)
        record = key.record() if key is not None else None
        turn = await self.turns.begin(tenant, session_id, kind, body, record)
        if isinstance(turn, Replay):
            self.metrics.replayed(tenant)
            if body.get("stream"):
                return SSEResponse(replay_stream(kind, body, turn), headers=REPLAYED)
            return JSONResponse(with_session(turn.answer, turn.session), headers=REPLAYED)

        async def finish(gen: Generation) -> tuple[dict[str, Any], SessionInfo]:
            out = shape(turn, gen, body)
            self.metrics.cached("explicit", gen.usage)
            return out, await self.turns.commit(turn, gen, answer=out)

        try:
            if body.get("stream"):  # from here on, the stream ends the turn
                return await self._stream(turn, body)
            out, info = await self.turns.run(turn, finish)
        except asyncio.CancelledError:
            with bind_session(session_id):
                log.info("turn dropped: the client left before its answer")
            raise
        return JSONResponse(with_session(out, session_ref(info)))

    async def _stream(self, turn: Turn, body: dict[str, Any]) -> SSEResponse:
        shaper = ChunkShaper(turn.kind, turn.model, bool(body.get("return_token_ids")))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def finish(gen: Generation) -> dict[str, Any]:
            answer = shape(turn, gen, body, shaper) if turn.idempotency else None
            self.metrics.cached("explicit", gen.usage)
            return session_ref(await self.turns.commit(turn, gen, answer=answer))

        return await self.turns.stream(turn, shaper, include_usage, finish)

    async def passthrough(
        self,
        tenant: str,
        kind: str,
        raw: bytes,
        body: dict[str, Any],
        first: FirstRequest | None = None,
    ) -> Response:
        """No session: the request goes as it is (plus the tenant's `cache_salt`) to the
        least-loaded healthy worker. A stream whose tokens are counted also asks the worker
        for its usage (`with_usage`). `first`: a new implicit session's first request
        (`gateway.implicit.first`), which adds its KV tag and reads its answer."""
        path = PATHS[kind]
        body, raw, _ = engine_bytes(body, raw)  # (OpenAI's prompt-caching fields: ours)
        if kind == "chat":
            self.turns.reasoning.check_raw(raw, body)
            raw = passthrough_tool_choice(body, raw)  # (`allowed_tools`: for the engine)
        affinity = None
        if first is not None:
            raw, affinity = first.engine_raw(raw, body), first.affinity
        stream, counted = body.get("stream"), metering.counted()
        drop_usage = False
        if stream and counted:
            raw, drop_usage = with_usage(body, raw)
        raw = self.salt.salted(tenant, body, raw)
        t0 = time.perf_counter()
        call = metering.call()
        if stream:
            with call:
                upstream, _ = await failover(
                    self.pool, body["model"], lambda w: open_stream(w, path, raw), affinity=affinity
                )
            call.streaming()
            self.metrics.relayed_streams.inc()
            tap = UsageTap(call, drop=drop_usage) if counted else None
            return relayed(self.pool, upstream, self.metrics, t0, tap, first)
        with call:
            (status, payload), worker = await failover(
                self.pool, body["model"], lambda w: post_raw(w, path, raw), affinity=affinity
            )
        if first is not None and status < 400:
            payload = first.answer(payload, worker)
        if status >= 400:
            call.refused()  # the worker's error answer: the engine ran nothing
            payload = refused_payload(status, payload)  # (a refusal: in our envelope)
        else:  # not streamed: the first token came with the whole answer
            call.answered()  # (its usage is in it: the rate limiter reads it there)
            seconds = time.perf_counter() - t0
            self.metrics.first_token("plain", seconds, streamed=False)
            self.metrics.completed("plain", seconds)
        return Response(payload, status_code=status, media_type="application/json")


async def replay_stream(
    kind: str, body: dict[str, Any], replay: Replay
) -> AsyncGenerator[bytes, None]:
    """The recorded answer of a streamed write (a turn, a create), as the same stream: its
    text in one chunk, the usage chunk if asked for, `[DONE]`."""
    answer = replay.answer
    shaper = ChunkShaper(kind, answer["model"], bool(body.get("return_token_ids")))
    shaper.id, shaper.created = answer["id"], answer["created"]
    choice = answer["choices"][0]
    if kind == "chat":  # the whole message in one delta (tool calls with their index)
        message = dict(choice["message"])
        message.pop("role", None)
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        event = {"delta": message, "finish_reason": choice.get("finish_reason")}
    else:
        event = {"text": choice["text"], "finish_reason": choice.get("finish_reason")}
    yield shaper.content({**event, "token_ids": choice.get("token_ids")})
    if (body.get("stream_options") or {}).get("include_usage"):
        yield shaper.usage(answer["usage"], replay.session)
    yield DONE


def with_usage(doc: dict[str, Any], raw: bytes) -> tuple[bytes, bool]:
    """A streamed body (`doc`, its JSON `raw`) that asks the engine for its usage chunk
    (`stream_options.include_usage`), and whether the client did not ask for it (the relay
    then takes that chunk out). `doc` is changed to match. The bytes are kept when the
    client asked already, or sent `stream_options` the engine refuses anyway."""
    options = doc.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") not in (None, False):
        return raw, False  # (the client's own: the engine says what it makes of it)
    if "stream_options" not in doc:  # the usual case: added to the bytes as they are
        doc["stream_options"] = {"include_usage": True}
        end = raw.rindex(b"}")  # the object's own: only whitespace may follow it
        return raw[:end] + b',"stream_options":{"include_usage":true}' + raw[end:], True
    if options is not None and not isinstance(options, dict):
        return raw, False
    options = {**(options or {}), "include_usage": True}
    options.pop("continuous_usage_stats", None)  # (usage in every chunk: not what it asked)
    doc["stream_options"] = options
    return orjson.dumps(doc), True


def routable(doc: dict[str, Any]) -> bool:
    """A request with a model and no session, streaming or not: only routed."""
    stream = doc.get("stream")
    if not (stream is None or type(stream) is bool):
        return False  # validation says what is wrong
    if "session_id" in doc or "session_append" in doc:
        return False
    model = doc.get("model")
    return isinstance(model, str) and bool(model)
