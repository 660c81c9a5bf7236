"""The hot path of a request without a session: bytes in, bytes out, no framework.

A `/v1/completions` or `/v1/chat/completions` request with no `session_id` (body or
header) and no `stream` is only routed: check the key, pick the least-loaded worker for
its model, pass the body through, pass the answer back. This ASGI layer does exactly that
with the same pieces the FastAPI routes use (`KeyRing`, `WorkerPool`, `post_raw` with its
failover, the error envelope) and hands everything else — sessions, streaming, any body
it cannot route at a glance — to the FastAPI app, body included, untouched. FastAPI's
per-request machinery (routing, dependency solving, validation, exception and telemetry
middleware) was most of the gateway's cost on this path (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ctxcache.errors import CtxError, InvalidRequest, PayloadTooLarge, error_response
from gateway.auth import authorization
from gateway.metrics import GatewayMetrics
from gateway.upstream import post_raw

FAST_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_JSON_HEADERS = [(b"content-type", b"application/json")]


class FastPath:
    def __init__(
        self, app: ASGIApp, *, state: Any, metrics: GatewayMetrics, max_body_bytes: int
    ) -> None:
        self.app = app
        self.state = state  # the FastAPI app's state: keys, pool, turns (set in the lifespan)
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in FAST_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if b"x-session-id" in headers:
            await self.app(scope, receive, send)
            return
        body = await self._read(receive)
        if body is None:  # over the limit
            await error_response(PayloadTooLarge())(scope, receive, send)
            return
        doc = _routable(body)
        if doc is None:  # a session turn, a stream, or something to validate in full
            await self.app(scope, _replay(body, receive), send)
            return
        t0 = time.perf_counter()
        status = 500
        try:
            tenant = self.state.keys.tenant_for(authorization(scope["headers"]))
            turns = self.state.turns
            out = orjson.dumps(doc) if turns.salt.apply(tenant, doc) else body
            (status, payload), _ = await turns.failover(
                doc["model"], lambda w: post_raw(w, scope["path"], out)
            )
            length = (b"content-length", str(len(payload)).encode())
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [*_JSON_HEADERS, length],
                }
            )
            await send({"type": "http.response.body", "body": payload})
        except CtxError as exc:
            status = exc.status
            await error_response(exc)(scope, receive, send)
        finally:
            self.metrics.observe(scope["path"], status, time.perf_counter() - t0)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise InvalidRequest("client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _routable(body: bytes) -> dict[str, Any] | None:
    """The parsed body, if it is a plain non-streaming request with a model, no session."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if (
        not isinstance(doc, dict)
        or doc.get("stream")
        or "session_id" in doc
        or "session_append" in doc
    ):
        return None
    model = doc.get("model")
    return doc if isinstance(model, str) and model else None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
