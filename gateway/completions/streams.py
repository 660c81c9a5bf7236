"""Every streamed answer of the gateway, through one ASGI response: `SSEResponse`.

A stream without a session passes the worker's bytes on as they arrive (`relayed`); a
session turn's events are shaped by `TurnService.stream`. Either way one task watches for
the client to leave (`ctxcache.disconnect`); if it does, the stream is cancelled, its
generator closed, and so the worker's connection: the worker stops generating for nobody.

A stream that breaks off mid-answer (the worker's connection drops, `WorkerDown`, or a
`CtxError` such as a commit the store refused) cannot change the status already sent. It
ends with one last event, OpenAI's error envelope (`data: {"error": {...}}`, which the
openai SDK raises as an `APIError`; a worker that dropped is `backend_unavailable`), then
without its last chunk (no `[DONE]`): the server closes the client's connection, so any
client sees a cut answer, never a complete-looking one. A stream whose format ends badly
by itself (a Responses stream's `response.failed` and `error` events) raises nothing here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import orjson
from fastapi import Response
from starlette.types import Message, Receive, Scope, Send

from ctxcache.disconnect import ClientLeft, until_the_client_leaves
from ctxcache.errors import BackendUnavailable, CtxError
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.upstream import SSEStream, WorkerDown

SSE_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
]
_START: Message = {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}
log = logging.getLogger(__name__)


class SSEResponse(Response):
    """Server-sent events from `events`, as they come. `never_started`, if any, runs if
    the response ends before the generator was first entered (its own `finally` cleans up
    once it was)."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        never_started: Callable[[], Awaitable[None]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.events, self.never_started = events, never_started
        self.status_code = 200
        self.background = None
        self.raw_headers = SSE_HEADERS
        if headers:
            extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
            self.raw_headers = [*SSE_HEADERS, *extra]
        self.client_left = False  # (once answered) the client left before the end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def stream() -> None:
            nonlocal started
            await send(
                _START
                if self.raw_headers is SSE_HEADERS
                else {**_START, "headers": self.raw_headers}
            )
            started = True  # from the first step on, the generator's own `finally` runs
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

        try:
            await until_the_client_leaves(receive, stream())
        except ClientLeft:
            log.info("the client left mid-stream: the stream is dropped")
            self.client_left = True
            return
        except (CtxError, WorkerDown) as exc:  # the status is sent: the answer is cut
            log.warning("a stream broke off mid-answer: %s", exc)
            if started:
                await send(
                    {"type": "http.response.body", "body": broke_off(exc), "more_body": True}
                )
            return
        finally:
            if started:
                await self.events.aclose()
            elif self.never_started is not None:
                await self.never_started()
        await send(_END)


def broke_off(exc: CtxError | WorkerDown) -> bytes:
    """The last event of a stream that broke off: the error's OpenAI envelope."""
    if isinstance(exc, WorkerDown):
        exc = BackendUnavailable(f"the inference worker failed mid-answer: {exc}")
    return b"data: " + orjson.dumps(exc.envelope()) + b"\n\n"


def relayed(
    pool: WorkerPool, upstream: SSEStream, metrics: GatewayMetrics, t0: float
) -> SSEResponse:
    """A stream without a session: the worker's bytes, passed on as they arrive, nothing
    parsed or re-serialised (timed from `t0`, the request's start, as `plain`)."""

    async def events() -> AsyncGenerator[bytes, None]:
        first = True
        try:
            async with pool.lease(upstream.worker):
                async for chunk in upstream.raw():
                    if first:  # (the first bytes: the role chunk or the first token)
                        metrics.first_token("plain", time.perf_counter() - t0)
                        first = False
                    yield chunk
            metrics.completed("plain", time.perf_counter() - t0)
        finally:
            await upstream.aclose()

    return SSEResponse(events(), upstream.aclose)
