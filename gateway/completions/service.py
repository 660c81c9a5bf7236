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
from typing import Any

from fastapi import Response
from pydantic import BaseModel

from ctxcache.errors import InvalidRequest
from ctxcache.logs import bind_session
from ctxcache.responses import JSONResponse
from gateway.completions.streams import SSEResponse, relayed
from gateway.pool import WorkerPool
from gateway.protocol import ChatBody, CompletionBody
from gateway.requests import parse_body, parse_json, session_id_of
from gateway.shaping import (
    CHAT_ONLY_UNSUPPORTED,
    ChunkShaper,
    chat_completion,
    session_ref,
    text_completion,
)
from gateway.turns import Generation, Turn, TurnService
from gateway.upstream import open_stream, post_raw

log = logging.getLogger(__name__)
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
KINDS = {path: kind for kind, path in PATHS.items()}
BODIES: dict[str, type[BaseModel]] = {"chat": ChatBody, "completion": CompletionBody}


class CompletionService:
    def __init__(self, turns: TurnService, pool: WorkerPool) -> None:
        self.turns = turns
        self.pool = pool

    async def serve(
        self, tenant: str, kind: str, raw: bytes, session_header: str | None
    ) -> Response:
        """A request to one of the two routes, from its raw body."""
        doc = parse_body(raw)
        if doc is None or session_header is not None or not routable(doc):
            return await self.answer(tenant, kind, raw, session_header, parsed=doc)
        return await self.passthrough(tenant, kind, raw, doc)

    async def answer(
        self,
        tenant: str,
        kind: str,
        raw: bytes,
        session_header: str | None,
        *,
        parsed: dict[str, Any] | None = None,
    ) -> Response:
        """A completion request from its raw body (`parsed`: the same, already decoded):
        validated, then passed through to a worker, or run as a session turn."""
        body, _ = parse_json(raw, BODIES[kind], parsed)
        return await self.handle(tenant, kind, raw, body, session_id_of(body, session_header))

    async def handle(
        self, tenant: str, kind: str, raw: bytes, body: dict[str, Any], session_id: str | None
    ) -> Response:
        if session_id is None:
            return await self.passthrough(tenant, kind, raw, body)
        if kind == "chat":
            bad = [k for k in CHAT_ONLY_UNSUPPORTED if body.get(k) not in (None, False)]
            if bad:
                raise InvalidRequest(f"{bad[0]} is not supported on a session turn", param=bad[0])
        turn = await self.turns.begin(tenant, session_id, kind, body)
        try:
            if body.get("stream"):  # from here on, the stream releases the lock
                return await self._stream(turn, body)
            gen = await self.turns.generate(turn)
            info = await self.turns.commit(turn, gen)
        except BaseException as exc:
            await self.turns.release_now(tenant, turn.state)
            if isinstance(exc, asyncio.CancelledError):
                with bind_session(session_id):
                    log.info("turn dropped: the client left before its answer")
            raise
        return JSONResponse(self._shape(turn, gen, session_ref(info), body))

    @staticmethod
    def _shape(
        turn: Turn, gen: Generation, session: dict[str, Any], body: dict[str, Any]
    ) -> dict[str, Any]:
        if turn.kind == "chat":
            out = chat_completion(turn.model, gen.text, gen.finish_reason, gen.usage)
        else:
            ids = gen.token_ids if body.get("return_token_ids") else None
            out = text_completion(turn.model, gen.text, gen.finish_reason, gen.usage, ids)
        out["session_id"] = session["session_id"]
        out["session"] = session
        return out

    async def _stream(self, turn: Turn, body: dict[str, Any]) -> SSEResponse:
        shaper = ChunkShaper(turn.kind, turn.model, bool(body.get("return_token_ids")))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def on_done(gen: Generation) -> dict[str, Any]:
            return session_ref(await self.turns.commit(turn, gen))

        upstream = await self.turns.open_stream(turn)

        async def never_started() -> None:
            await self.turns.release_now(turn.tenant, turn.state)
            await upstream.aclose()

        events = self.turns.stream(turn, upstream, shaper, include_usage, on_done)
        return SSEResponse(events, never_started)

    async def passthrough(
        self, tenant: str, kind: str, raw: bytes, body: dict[str, Any]
    ) -> Response:
        """No session: the request goes as it is (plus the tenant's `cache_salt`) to the
        least-loaded healthy worker."""
        path = PATHS[kind]
        raw = self.turns.salt.salted(tenant, body, raw)
        if body.get("stream"):
            upstream, _ = await self.turns.failover(
                body["model"], lambda w: open_stream(w, path, raw)
            )
            self.turns.metrics.relayed_streams.inc()
            return relayed(self.pool, upstream)
        (status, payload), _ = await self.turns.failover(
            body["model"], lambda w: post_raw(w, path, raw)
        )
        return Response(payload, status_code=status, media_type="application/json")


def routable(doc: dict[str, Any]) -> bool:
    """A request with a model and no session, streaming or not: only routed."""
    stream = doc.get("stream")
    if not (stream is None or type(stream) is bool):
        return False  # validation says what is wrong
    if "session_id" in doc or "session_append" in doc:
        return False
    model = doc.get("model")
    return isinstance(model, str) and bool(model)
