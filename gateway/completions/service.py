"""`/v1/completions` and `/v1/chat/completions`: a pass-through, or a session turn."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from ctxcache.errors import InvalidRequest
from ctxcache.http_server import raw_transport
from ctxcache.responses import JSONResponse
from gateway.pool import Worker, WorkerPool
from gateway.protocol import ChatBody, CompletionBody
from gateway.requests import parse_json, session_id_of
from gateway.shaping import (
    CHAT_ONLY_UNSUPPORTED,
    ChunkShaper,
    chat_completion,
    session_ref,
    text_completion,
)
from gateway.turns import Generation, Turn, TurnService
from gateway.upstream import SSEStream, open_stream, post_raw

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
KINDS = {path: kind for kind, path in PATHS.items()}
BODIES: dict[str, type[BaseModel]] = {"chat": ChatBody, "completion": CompletionBody}
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class SSERelay(Response):
    """A stream without a session: the worker's bytes, passed on as they arrive.

    Nothing is parsed or re-serialised, and no task group runs beside it (Starlette's
    `StreamingResponse` starts one per response to watch for the client leaving, which
    cost more than the relaying): one task waits for the client to leave, and if it does
    the worker's stream is closed, so the worker stops generating for nobody.
    """

    media_type = "text/event-stream"

    def __init__(self, pool: WorkerPool, worker: Worker, upstream: SSEStream) -> None:
        self.pool, self.worker, self.upstream = pool, worker, upstream
        self.status_code = 200
        self.background = None
        self.raw_headers = _SSE_RAW_HEADERS  # built once (`init_headers` on every stream cost)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        relaying, client_left = True, False

        def on_leave(_: object) -> None:
            nonlocal client_left
            if relaying:  # (after the last byte, `receive` says disconnect too)
                client_left = True
                relay.cancel()

        watch = asyncio.ensure_future(_disconnect(receive))
        watch.add_done_callback(on_leave)
        try:
            async with self.pool.lease(self.worker):
                await self._relay(scope, send)
                relaying = False
        except asyncio.CancelledError:
            if not client_left:
                raise
            relay.uncancel()  # the client left: nobody is left to answer
            return
        finally:
            relaying = False
            watch.cancel()
            await self.upstream.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _relay(self, scope: Scope, send: Send) -> None:
        """The worker's body, passed on. A chunked one keeps the worker's framing and goes
        straight to the client's connection where the server allows it
        (`ctxcache.http_server.raw_transport`); otherwise each piece goes through `send`,
        which frames it again."""
        framed = self.upstream.framed
        transport = None if framed is None else raw_transport(scope)
        if framed is None or transport is None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.upstream.raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_CHUNKED})
        async for part in framed():
            transport.write(part)
            if transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                await send(_NOTHING_MORE_YET)  # the server waits until the client catches up


_SSE_RAW_HEADERS = [
    *((k.encode(), v.encode()) for k, v in SSE_HEADERS.items()),
    (b"content-type", b"text/event-stream; charset=utf-8"),
]
_SSE_CHUNKED = [*_SSE_RAW_HEADERS, (b"transfer-encoding", b"chunked")]
_WRITE_HIGH_WATER = 1 << 16
_NOTHING_MORE_YET = {"type": "http.response.body", "body": b"", "more_body": True}


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class TurnStream(StreamingResponse):
    """A session turn's SSE answer. The event generator releases the turn when it ends;
    a client that leaves before the first byte means it never starts, and then nothing
    would: `never_started` does it here."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], never_started: Callable[[], Awaitable[None]]
    ) -> None:
        self.events, self.never_started = events, never_started
        self.started = False
        super().__init__(self._body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _body(self) -> AsyncGenerator[bytes, None]:
        self.started = True
        try:
            async for chunk in self.events:
                yield chunk
        finally:
            await self.events.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.started:
                await self.never_started()


class CompletionService:
    def __init__(self, turns: TurnService, pool: WorkerPool) -> None:
        self.turns = turns
        self.pool = pool

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
        validated, then passed through to a worker, or run as a session turn. (The FastAPI
        routes and `gateway.fastpath` both answer through here.)"""
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
        except BaseException:
            await self.turns.release_now(tenant, turn.state)
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

    async def _stream(self, turn: Turn, body: dict[str, Any]) -> StreamingResponse:
        shaper = ChunkShaper(turn.kind, turn.model, bool(body.get("return_token_ids")))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def on_done(gen: Generation) -> dict[str, Any]:
            return session_ref(await self.turns.commit(turn, gen))

        upstream = await self.turns.open_stream(turn)

        async def never_started() -> None:
            await self.turns.release_now(turn.tenant, turn.state)
            await upstream.aclose()

        events = self.turns.stream(turn, upstream, shaper, include_usage, on_done)
        return TurnStream(events, never_started)

    async def passthrough(
        self, tenant: str, kind: str, raw: bytes, body: dict[str, Any]
    ) -> Response:
        """No session: the request goes as it is (plus the tenant's `cache_salt`) to the
        least-loaded healthy worker."""
        path = PATHS[kind]
        if self.turns.salt.apply(tenant, body):
            raw = orjson.dumps(body)
        if body.get("stream"):
            upstream, worker = await self.turns.failover(
                body["model"], lambda w: open_stream(w, path, raw)
            )
            return SSERelay(self.pool, worker, upstream)
        (status, payload), _ = await self.turns.failover(
            body["model"], lambda w: post_raw(w, path, raw)
        )
        return Response(payload, status_code=status, media_type="application/json")
