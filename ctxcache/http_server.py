"""uvicorn's httptools protocol, with the writes of one event-loop turn sent together.

uvicorn writes a response's head, each body part and a chunked stream's end marker with a
`transport.write` each, and each is a `send` of its own: a plain JSON answer goes out as
two TCP segments (the client wakes for the head, then again for the body), a streamed one
as three or more. Here the protocol's transport holds a write until the next one or the
end of the loop's turn (`CoalescingTransport`): head and body of a plain answer go out in
one call, and a stream's head with its first events. docs/benchmarks.md, "Gateway hot
path", has what it saves.

Every ctxcache service serves through it (`ctxcache.settings.serve_app`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport that holds a write until the next one or the end of the loop's turn,
    whichever comes first, and then sends what it holds in one `writelines`.

    A response's head is held until its body's first part is written (a plain answer's
    whole body; a stream's first events, when they are already in) and both go out
    together, at once; a write with nothing after it in its turn waits only for the
    running task to yield. Everything but `write`, `close` and `get_write_buffer_size` is
    the real transport's (flow control included: the real buffer still pauses the protocol).
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._flush_due = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data or self._transport.is_closing():
            return  # (a closed connection drops what is written to it, as asyncio's do)
        if self._held:  # the write it waited for: both go out now
            held, self._held = self._held, []
            held.append(bytes(data))
            self._transport.writelines(held)
            return
        self._held.append(bytes(data))
        if not self._flush_due:
            self._flush_due = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.writelines(held)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self._flush()  # what was written before close goes out first, as with any transport
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `CoalescingTransport`, which each request's scope
    names under `extensions[RAW_BODY]["transport"]` (see `raw_transport`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        coalescing = CoalescingTransport(transport, asyncio.get_running_loop())
        super().connection_made(coalescing)  # type: ignore[arg-type]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {RAW_BODY: {"transport": self.transport}}


RAW_BODY = "ctxcache.raw_body"


def raw_transport(scope: Scope) -> asyncio.Transport | None:
    """Where a response whose head declared `transfer-encoding: chunked` may write body
    bytes already in chunked framing, unframed again by nobody (a relay passes a worker's
    stream on this way); None when the app is not served by this protocol (tests that
    call it in process). The response still ends with an ASGI body message with
    `more_body: False`, which writes the last chunk."""
    extension = scope.get("extensions", {}).get(RAW_BODY)
    return None if extension is None else extension["transport"]  # type: ignore[no-any-return]
