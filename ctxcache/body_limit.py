"""A request body size limit whose 413 is the OpenAI envelope like every other error.

A declared Content-Length over the limit is refused before the body is read; one within it
is all the server reads (it frames the body by that length), so the request passes on
untouched. A chunked body is counted as it arrives and refused once it passes the limit.
(Wrapping every request's `receive` cost ~0.15× of the gateway's streaming TTFT ratio,
docs/benchmarks.md.)
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ctxcache.errors import PayloadTooLarge, error_response


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:  # (the server refuses such a request first) counted
                    declared = None
            elif name == b"transfer-encoding":
                chunked = True
        if declared is not None and declared > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        if declared is not None and not chunked:  # framed by its length: nothing to count
            await self.app(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise self._too_large()  # mapped to the envelope by the app's error handler
            return message

        await self.app(scope, counted, send)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body over {self.max_bytes} bytes")
