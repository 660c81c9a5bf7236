"""`POST /v1/completions` and `POST /v1/chat/completions`: read, call, answer.

The two busiest routes are plain ASGI endpoints in the app's router (Starlette `Route`s),
not FastAPI operations: most of their requests are only routed to a worker, and FastAPI's
per-request machinery (dependency solving, the endpoint wrapper, response validation)
cost more than the routing itself (docs/benchmarks.md, "Gateway"). They sit behind the
same middleware and error handlers as every other route; `openapi_paths` documents them.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ctxcache.disconnect import ClientLeft, until_the_client_leaves
from gateway.auth import authorization
from gateway.completions.service import PATHS, CompletionService
from gateway.completions.streams import SSEResponse
from gateway.protocol import ChatBody, CompletionBody
from gateway.requests import body_doc

log = logging.getLogger(__name__)


class CompletionsEndpoint:
    """One of the two routes (`kind`: "completion" or "chat"), as an ASGI app."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope["app"].state
        headers = scope["headers"]
        tenant = state.keys.tenant_for(authorization(headers))
        service: CompletionService = state.completions
        try:  # a client that leaves cancels its request, on the worker too
            body = await read_body(receive)
            keys = [v.decode("latin-1") for k, v in headers if k == b"idempotency-key"]
            answer = service.serve(
                tenant, self.kind, body, header(headers, b"x-session-id"), keys or None
            )
            response = await until_the_client_leaves(receive, answer)
        except ClientLeft:
            log.debug("the client left before its answer: its request is cancelled")
            state.metrics.cancelled(tenant)
            return
        await response(scope, receive, send)
        if isinstance(response, SSEResponse) and response.client_left:
            state.metrics.cancelled(tenant)


async def read_body(receive: Receive) -> bytes:
    """The request's body (the body-size limit is the middleware's); `ClientLeft` if the
    client disconnects first."""
    message = await receive()
    body = message.get("body", b"")
    while message.get("more_body", False):
        message = await receive()
        body += message.get("body", b"")
    if message["type"] == "http.disconnect":
        raise ClientLeft()
    return body  # type: ignore[no-any-return]


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    """A header's first value (as Starlette's `request.headers.get` reads it)."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def routes() -> list[Route]:
    """The two routes, for one app."""
    return [
        Route(path, CompletionsEndpoint(kind), methods=["POST"]) for kind, path in PATHS.items()
    ]


def openapi_paths() -> dict[str, Any]:
    """The two routes' operations, for the OpenAPI document."""
    summaries = {"completion": "Create a completion", "chat": "Create a chat completion"}
    models = {"completion": CompletionBody, "chat": ChatBody}
    answers = {
        "description": "The completion; with `stream: true`, server-sent events (each "
        "`data:` a chunk object, then `[DONE]`)",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
    return {
        path: {
            "post": {
                "summary": summaries[kind],
                "operationId": f"create_{kind}",
                **body_doc(models[kind]),
                "responses": {"200": answers},
            }
        }
        for kind, path in PATHS.items()
    }
