"""uvicorn's httptools protocol, with the writes of one event-loop turn sent together.

uvicorn writes a response's head, each body part and a chunked stream's end marker with a
`transport.write` each, and each is a `send` of its own: a plain JSON answer goes out as
two TCP segments (the client wakes for the head, then again for the body), a streamed one
as one per event and more. Here the protocol's transport sends the writes of one event-loop
turn together (`CoalescingTransport`): head and body of a plain answer in one call, a
stream's head with its first events, and events that arrived together in one call.
docs/benchmarks.md, "Gateway (`ctxcache bench gateway`)", has what it saves.

Every ctxcache service serves through it (`ctxcache.settings.serve_app`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.types import Scope
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport that sends the writes of one event-loop turn together.

    Within a turn, the first two writes go out together as soon as the second is made: a
    response's head and its body (a plain answer's whole body; a stream's first events),
    so a client waits for neither. Every other write is held until the turn ends (until the
    running task yields), then sent with the rest in one `writelines`: a burst of stream
    events that arrived together leaves as one send. Everything but `write`, `close` and
    `get_write_buffer_size` is the real transport's (flow control included: the real buffer
    still pauses the protocol).
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._turn_started = False  # a write was made in this turn (a flush is due at its end)
        self._pair_sent = False  # this turn's first two writes went out already

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data or self._transport.is_closing():
            return  # (a closed connection drops what is written to it, as asyncio's do)
        held = self._held
        held.append(bytes(data))
        if not self._turn_started:
            self._turn_started = True
            self._loop.call_soon(self._flush)
        elif len(held) == 2 and not self._pair_sent:  # a head and its body: both go now
            self._pair_sent = True
            self._held = []
            self._transport.writelines(held)

    def _flush(self) -> None:
        self._turn_started = self._pair_sent = False
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
    bytes that are already in chunked framing, to go out as they are (a relay passes a
    worker's stream on this way); None when the app is not served by this protocol (tests
    that call it in process). The response still ends with an ASGI body message with
    `more_body: False`, which writes the last chunk."""
    extension = scope.get("extensions", {}).get(RAW_BODY)
    return None if extension is None else extension["transport"]  # type: ignore[no-any-return]
