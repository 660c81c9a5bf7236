"""The three calls of every turn — get, begin, append — without FastAPI's per-request cost.

The same service, request and response models, token check and error envelopes as the
FastAPI routes in `router.py` (which stay, for the OpenAPI document and every other call);
only the framework's routing, dependency solving and middleware layers are skipped. That
layer cost about 0.3 ms a call, as much as the Redis round trip it wraps
(docs/benchmarks.md). Anything this layer does not recognise goes to the FastAPI app
unchanged.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from cache_manager.protocol import AppendTurn, BeginTurn
from ctxcache.errors import (
    CtxError,
    InvalidAPIKey,
    InvalidRequest,
    error_response,
    validation_detail,
)

log = logging.getLogger(__name__)
PREFIX = "/sessions/"


class ManagerFastPath:
    def __init__(self, app: FastAPI, *, token: str | None = None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None

    @property
    def state(self) -> Any:
        """The wrapped app's state (its service), as if this were the app."""
        return self.app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = _route(scope) if scope["type"] == "http" else None
        if route is None:
            await self.app(scope, receive, send)
            return
        op, session_id = route
        try:
            self._check_token(scope)
            service = self.app.state.service
            if op == "get":
                tenant = _query(scope).get("tenant", [""])[0]
                if not tenant:
                    raise InvalidRequest("tenant is required", param="tenant")
                out: BaseModel = await service.get(session_id, tenant)
            elif op == "begin":
                out = await service.begin(session_id, _parse(BeginTurn, await _body(receive)))
            else:
                out = await service.append(session_id, _parse(AppendTurn, await _body(receive)))
        except CtxError as exc:
            await error_response(exc)(scope, receive, send)
            return
        except Exception:
            log.exception("unhandled error on %s %s", scope["method"], scope["path"])
            await error_response(CtxError())(scope, receive, send)
            return
        payload = out.model_dump_json().encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    def _check_token(self, scope: Scope) -> None:
        if self.expected is None:
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            raise InvalidAPIKey("missing or invalid manager token")


def _route(scope: Scope) -> tuple[str, str] | None:
    path: str = scope["path"]
    if not path.startswith(PREFIX):
        return None
    rest = path[len(PREFIX) :]
    method = scope["method"]
    if "/" not in rest:
        return ("get", rest) if method == "GET" and rest else None
    session_id, _, action = rest.partition("/")
    if method == "POST" and action in ("begin", "append") and session_id:
        return action, session_id
    return None


def _query(scope: Scope) -> dict[str, list[str]]:
    return parse_qs(scope.get("query_string", b"").decode("latin-1"))


async def _body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse(model: type[Any], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        message, param = validation_detail(exc.errors())
        raise InvalidRequest(message, param=param) from None
