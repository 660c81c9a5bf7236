"""The two streamed answers of the completion routes, as lean ASGI responses.

Neither runs a task group beside the stream (Starlette's `StreamingResponse` starts one per
response to watch for the client leaving, which cost more than relaying the stream): one
task waits for the client to leave (`until_the_client_leaves`), and if it does the stream
is cancelled, so the worker's stream is closed and the worker stops generating for nobody.

* `SSERelay`: a stream without a session, the worker's bytes passed on as they arrive;
* `TurnStream`: a session turn's events, shaped by `TurnService.stream`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Response
from starlette.types import Message, Receive, Scope, Send

from ctxcache.http_server import raw_transport
from gateway.pool import Worker, WorkerPool
from gateway.upstream import SSEStream

SSE_HEADERS = [
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
]
_SSE_CHUNKED = [*SSE_HEADERS, (b"transfer-encoding", b"chunked")]
_START: Message = {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS}
_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}
_NOTHING_MORE_YET: Message = {"type": "http.response.body", "body": b"", "more_body": True}
_WRITE_HIGH_WATER = 1 << 16


async def until_the_client_leaves(receive: Receive, work: Coroutine[Any, Any, None]) -> bool:
    """Run `work` in this task, cancelled if the client disconnects meanwhile: True if it
    ran to its end, False if the client left first."""
    task = asyncio.current_task()
    assert task is not None
    running, left = True, False

    def on_leave(_: object) -> None:
        nonlocal left
        if running:  # (after the last byte, `receive` says disconnect too)
            left = True
            task.cancel()

    watch = asyncio.ensure_future(_disconnect(receive))
    watch.add_done_callback(on_leave)
    try:
        await work
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()  # the client left: nobody is left to answer
        return False
    finally:
        running = False
        watch.cancel()
    return True


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSERelay(Response):
    """A stream without a session: the worker's bytes, passed on as they arrive, nothing
    parsed or re-serialised."""

    media_type = "text/event-stream"

    def __init__(self, pool: WorkerPool, worker: Worker, upstream: SSEStream) -> None:
        self.pool, self.worker, self.upstream = pool, worker, upstream
        self.status_code = 200
        self.background = None
        self.raw_headers = SSE_HEADERS  # built once (`init_headers` on every stream cost)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with self.pool.lease(self.worker):
                ended = await until_the_client_leaves(receive, self._relay(scope, send))
        finally:
            await self.upstream.aclose()
        if ended:
            await send(_END)

    async def _relay(self, scope: Scope, send: Send) -> None:
        """The worker's body, passed on. A chunked one keeps the worker's framing and goes
        straight to the client's connection where the server allows it
        (`ctxcache.http_server.raw_transport`); otherwise each piece goes through `send`,
        which frames it again."""
        framed = self.upstream.framed
        transport = None if framed is None else raw_transport(scope)
        if framed is None or transport is None:
            await send(_START)
            async for chunk in self.upstream.raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_CHUNKED})
        async for part in framed():
            transport.write(part)
            if transport.get_write_buffer_size() > _WRITE_HIGH_WATER:
                await send(_NOTHING_MORE_YET)  # the server waits until the client catches up


class TurnStream(Response):
    """A session turn's SSE answer. The event generator releases the turn when it ends
    (committed or not); a client that leaves before the first byte means it never starts,
    and then nothing would: `never_started` does it here."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncGenerator[bytes, None], never_started: Callable[[], Awaitable[None]]
    ) -> None:
        self.events, self.never_started = events, never_started
        self.status_code = 200
        self.background = None
        self.raw_headers = SSE_HEADERS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def stream() -> None:
            nonlocal started
            await send(_START)
            started = True  # from the first step on, the generator's own `finally` runs
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

        try:
            ended = await until_the_client_leaves(receive, stream())
        finally:
            if started:
                await self.events.aclose()
            else:
                await self.never_started()
        if ended:
            await send(_END)
