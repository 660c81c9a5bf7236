"""The hot paths, `/v1/completions` and `/v1/chat/completions`, without the framework.

FastAPI's per-request machinery (routing, dependency solving, exception and telemetry
middleware) was most of the gateway's own cost on these two routes (docs/benchmarks.md),
so this ASGI layer in front of the app answers them itself, with the same pieces the
FastAPI routes use (`KeyRing`, `CompletionService.answer`, the error envelope, metrics):

* a request with no `session_id` (body or header) is only routed: check the key, pick the
  least-loaded worker for its model, pass the body through (plus the tenant's
  `cache_salt`), pass the answer back — bytes in, bytes out; a stream's bytes as they
  arrive (`CompletionService.passthrough`);
* everything else — session turns, bodies to validate — is validated and answered by
  `CompletionService.answer`, exactly as the FastAPI route would.

Every other route goes to the FastAPI app.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ctxcache.errors import CtxError, InvalidRequest, PayloadTooLarge, error_response
from ctxcache.http_server import EarlyAnswers
from gateway.auth import authorization
from gateway.completions.service import KINDS
from gateway.metrics import GatewayMetrics
from gateway.upstream import post_raw

FAST_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_JSON_HEADERS = [(b"content-type", b"application/json")]
log = logging.getLogger(__name__)


class FastPath:
    early_answers: EarlyAnswers | None = None  # for the server (`create_asgi` sets it)

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
        t0 = time.perf_counter()
        status = 500
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            body = await self._read(receive)
            if body is None:  # over the limit
                raise PayloadTooLarge()
            tenant = self.state.keys.tenant_for(authorization(scope["headers"]))
            session_header = first_header(scope["headers"], b"x-session-id")
            doc = parse_body(body)
            completions = self.state.completions
            kind = KINDS[scope["path"]]
            if doc is None or session_header is not None or not routable(doc):
                # a session turn, or a body to validate in full (parsed once)
                response = await completions.answer(
                    tenant,
                    kind,
                    body,
                    session_header,
                    parsed=doc,
                    idempotency_key=[
                        v.decode("latin-1") for k, v in scope["headers"] if k == b"idempotency-key"
                    ]
                    or None,
                )
            elif doc.get("stream"):
                response = await completions.passthrough(tenant, kind, body, doc)
            else:
                status = await self._route(scope["path"], tenant, body, doc, send_tracked)
                return
            status = response.status_code
            await response(scope, receive, send_tracked)
        except Exception as exc:
            if not isinstance(exc, CtxError):
                log.exception("unhandled error on POST %s", scope["path"])
                exc = CtxError()
            if started:  # an answer is under way: all that is left is to end it
                raise
            status = exc.status
            await error_response(exc)(scope, receive, send)
        finally:
            self.metrics.observe(scope["path"], status, time.perf_counter() - t0)

    async def _route(
        self, path: str, tenant: str, body: bytes, doc: dict[str, Any], send: Send
    ) -> int:
        """A plain request, bytes in, bytes out: the worker's status."""
        turns = self.state.turns
        out = turns.salt.salted(tenant, doc, body)
        (status, payload), _ = await turns.failover(doc["model"], lambda w: post_raw(w, path, out))
        length = (b"content-length", str(len(payload)).encode())
        await send(
            {"type": "http.response.start", "status": status, "headers": [*_JSON_HEADERS, length]}
        )
        await send({"type": "http.response.body", "body": payload})
        return int(status)

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


def parse_body(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None (the full validation then says what is wrong)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def routable(doc: dict[str, Any]) -> bool:
    """A request with a model and no session, streaming or not: only routed."""
    stream = doc.get("stream")
    if not (stream is None or type(stream) is bool):
        return False  # validation says what is wrong
    if "session_id" in doc or "session_append" in doc:
        return False
    model = doc.get("model")
    return isinstance(model, str) and bool(model)


def first_header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of a header, as Starlette's `request.headers.get` reads it."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
