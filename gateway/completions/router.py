"""`POST /v1/completions` and `POST /v1/chat/completions`: read, call, answer.

The two busiest routes are plain ASGI endpoints in the app's router (Starlette `Route`s),
not FastAPI operations: most of their requests are only routed to a worker, and FastAPI's
per-request machinery (dependency solving, the endpoint wrapper, response validation)
cost more than the routing itself (docs/benchmarks.md, "Gateway"). They sit behind the
same middleware and error handlers as every other route; `openapi_paths` documents them.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.auth import authorization
from gateway.completions.service import PATHS, CompletionService
from gateway.protocol import ChatBody, CompletionBody
from gateway.requests import body_doc


class CompletionsEndpoint:
    """One of the two routes (`kind`: "completion" or "chat"), as an ASGI app."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        state = request.app.state
        tenant = state.keys.tenant_for(authorization(scope["headers"]))
        service: CompletionService = state.completions
        session_header = request.headers.get("x-session-id")
        response = await service.serve(tenant, self.kind, await request.body(), session_header)
        await response(scope, receive, send)


routes = [Route(path, CompletionsEndpoint(kind), methods=["POST"]) for kind, path in PATHS.items()]


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
