"""Every streamed answer of the gateway, through one ASGI response: `SSEResponse`.

A stream without a session passes the worker's bytes on as they arrive (`relayed`); a
session turn's events are shaped by `TurnService.stream`. Either way one task watches for
the client to leave (`ctxcache.disconnect`); if it does, the stream is cancelled, its
generator closed, and so the worker's connection: the worker stops generating for nobody.

A stream that breaks off mid-answer (the worker's connection drops, `WorkerDown`, or a
`CtxError` such as a commit the store refused) cannot change the status already sent. It
ends with one last event, OpenAI's error envelope (`data: {"error": {...}}`, which the
openai SDK raises as an `APIError`; a worker that dropped is `backend_unavailable`, any
other failure `internal_error`, logged with its traceback), then
without its last chunk (no `[DONE]`): the server closes the client's connection, so any
client sees a cut answer, never a complete-looking one. A stream whose format ends badly
by itself (a Responses stream's `response.failed` and `error` events) raises nothing here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import Response
from starlette.types import Message, Receive, Scope, Send

from ctxcache.disconnect import ClientLeft, until_the_client_leaves
from ctxcache.errors import BackendUnavailable, CtxError
from gateway.implicit.first import FirstRequest
from gateway.metering import EngineCall
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
_MAX_EVENT = 2**16  # an event longer than this is not a worker's: the tap lets go
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
        except Exception as exc:  # the status is sent: the answer is cut, with an error event
            if isinstance(exc, (CtxError, WorkerDown)):
                log.warning("a stream broke off mid-answer: %s", exc)
            else:  # a fault of ours
                log.exception("a stream failed mid-answer")
            if started:
                with contextlib.suppress(Exception):  # (a client already gone)
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


def broke_off(exc: Exception) -> bytes:
    """The last event of a stream that broke off: the error's OpenAI envelope (an error
    that is not a client's to see: `internal_error`, its details only in the log)."""
    if isinstance(exc, WorkerDown):
        exc = BackendUnavailable(f"the inference worker failed mid-answer: {exc}")
    elif not isinstance(exc, CtxError):
        exc = CtxError("the answer failed mid-stream (internal error)")
    return b"data: " + orjson.dumps(exc.envelope()) + b"\n\n"


def relayed(
    pool: WorkerPool,
    upstream: SSEStream,
    metrics: GatewayMetrics,
    t0: float,
    tap: UsageTap | None = None,
    new: FirstRequest | None = None,
) -> SSEResponse:
    """A stream without a session: the worker's bytes, passed on as they arrive, nothing
    re-serialised (timed from `t0`, the request's start, as `plain`). A request whose
    tokens are counted reads them on the way (`tap`); a new implicit session's first
    request (`new`) reads its answer and ids, and takes out the ids."""

    if new is not None:
        new.worker = upstream.worker

    async def events() -> AsyncGenerator[bytes, None]:
        first = True
        try:
            async with pool.lease(upstream.worker):
                async for chunk in upstream.raw():
                    if new is not None and not (chunk := new.feed(chunk)):
                        continue
                    if tap is not None and not (chunk := tap.feed(chunk)):
                        continue
                    if first:  # (the first bytes: the role chunk or the first token)
                        metrics.first_token("plain", time.perf_counter() - t0, streamed=True)
                        first = False
                    yield chunk
            rest = new.end(upstream.worker) if new is not None else b""
            if tap is not None:
                rest = tap.feed(rest) + tap.end() if rest else tap.end()
            if rest:
                yield rest
            metrics.completed("plain", time.perf_counter() - t0)
        finally:
            await upstream.aclose()

    return SSEResponse(events(), upstream.aclose)


class UsageTap:
    """A relayed stream's events, read as they pass, for the rate limiter: each event with
    choices counts one token relayed on `call`; the engine's usage chunk (asked for on
    every counted stream) gives `call` its usage. If the client did not ask for usage
    (`drop`), that chunk is taken out and the client gets the bytes the worker sends a
    request without `include_usage`: the rest as they came, in whole events (a partial one
    waits for its end). vLLM then moves `system_fingerprint` from each choice's last chunk
    to the usage chunk; so those last chunks wait for it, and get it back where vLLM
    writes it (the end of the chunk). Events framed otherwise than vLLM's and ctxcache's
    workers frame them (`\r\n\r\n`, or none within 64 KiB) pass untouched, usage chunk
    included, and the usage is read from the answer as the client gets it."""

    def __init__(self, call: EngineCall, *, drop: bool) -> None:
        self.call, self.drop = call, drop
        self.rest = b""
        self.held: list[bytes] = []  # (dropping) from a choice's last chunk to the usage
        self.off = False

    def feed(self, chunk: bytes) -> bytes:
        """What to pass on of `chunk`."""
        if self.off:
            return chunk
        data = self.rest + chunk
        end = data.rfind(b"\n\n") + 2
        if end < 2:  # no event ends here
            if b"\r\n\r\n" in data or len(data) > _MAX_EVENT:  # not a framing read here
                self.off, self.rest = True, b""
                self.call.answered()
                held, self.held = self.held, []
                return b"".join(e + b"\n\n" for e in held) + data if self.drop else chunk
            self.rest = data
            return b"" if self.drop else chunk
        events = data[:end].split(b"\n\n")[:-1]
        self.rest = data[end:]
        if not self.drop:
            for event in events:
                self._read(event)
            return chunk
        return b"".join(out for event in events for out in self._pass(event))

    def end(self) -> bytes:
        """What is left to pass on once the worker's stream ended."""
        rest, self.rest = self.rest, b""
        if not self.drop:
            if rest:
                self._read(rest)  # (its bytes have passed already)
            return b""
        usage = self._read(rest) if rest else None  # (a last event without its blank line)
        fingerprint = usage.get("system_fingerprint") if usage is not None else None
        held, self.held = self.held, []
        out = b"".join(_fingerprinted(e, fingerprint) + b"\n\n" for e in held)
        return out + (rest if usage is None else b"")

    def _pass(self, event: bytes) -> list[bytes]:
        """Dropping: what to pass on, now, of `event` and the events held."""
        usage = self._read(event)
        if usage is not None:  # the usage chunk: not passed on, its fingerprint is
            fingerprint, held, self.held = usage.get("system_fingerprint"), self.held, []
            return [_fingerprinted(e, fingerprint) + b"\n\n" for e in held]
        if self.held or b'"finish_reason":"' in event:
            self.held.append(event)
            return []
        return [event + b"\n\n"]

    def _read(self, event: bytes) -> dict[str, Any] | None:
        """Count one event; if it is the usage chunk, the chunk."""
        if not event.startswith(b"data:"):
            return None
        data = event[5:].strip()
        if data == b"[DONE]":
            return None
        if b'"total_tokens"' in data:
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                doc = None
            usage = doc.get("usage") if isinstance(doc, dict) else None
            if isinstance(usage, dict) and not doc.get("choices"):  # type: ignore[union-attr]
                self.call.done(usage)
                return doc  # type: ignore[no-any-return]
        self.call.relayed()
        return None


def _fingerprinted(event: bytes, fingerprint: object) -> bytes:
    """A choice's last chunk with the fingerprint vLLM writes there when it sends no usage
    chunk (its last field, as vLLM 0.x orders them), if it has none."""
    if not isinstance(fingerprint, str) or b'"system_fingerprint"' in event:
        return event
    if b'"finish_reason":"' not in event:
        return event
    end = event.rindex(b"}")
    return event[:end] + b',"system_fingerprint":' + orjson.dumps(fingerprint) + event[end:]
