"""uvicorn's httptools protocol, with the writes of one event-loop turn sent together.

uvicorn writes a response's head and each body part with a `transport.write` each, and
each is a `send` of its own: a plain JSON answer leaves as two TCP segments (the client is
woken for the head, then again for the body), a stream's head leaves apart from its first
event. `CoalescingTransport` holds what is written during one turn of the event loop and
sends it together when the turn ends: head and body of a plain answer in one send. An
event stream (`text/event-stream`) is the exception: its head waits only for the first
event, and they leave together the moment that event is written, as does every later
event: a client waits for its first token, and waiting for the turn's end put whatever
else the loop had to do first (docs/benchmarks.md, "Fourth pass", measures it).

`CoalescingHttp` is the protocol class every ctxcache service gives uvicorn (its public
`Config(http=...)` option, `ctxcache.settings.server_config`). It is a plain
`asyncio.Protocol` around uvicorn's own `HttpToolsProtocol`, which it builds with the
arguments uvicorn passes to any `http=` class and hands that transport: nothing of
uvicorn's but its constructor and asyncio's protocol interface is used, so uvicorn's
parsing, keep-alive, flow control and shutdown stay uvicorn's.
tests/ctxcache/test_http_protocol.py checks what this relies on.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport(asyncio.Transport):
    """A transport that sends the writes of one event-loop turn together.

    The first write of a turn schedules a flush (`loop.call_soon`): the writes made before
    the running task next waits leave in one `writelines`. After the head of an event
    stream, each write sends at once (with the head, the first time). These choices only
    move when bytes leave, never which or in what order. `close` and `write_eof` send what
    is held first, `abort` drops it, as a transport's own buffer would be. Everything else
    is the real transport's (its buffer still drives flow control; the held bytes are
    counted in `get_write_buffer_size`).
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._streaming = False  # the response being written is an event stream

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data or self._transport.is_closing():
            return  # (a closed connection drops what is written to it, as asyncio's do)
        if data[:5] == b"HTTP/":  # a response's head (uvicorn writes it in one piece)
            self._streaming = b"\r\ncontent-type: text/event-stream" in data
        elif self._streaming:  # an event leaves at once, the head with the first
            self._held.append(bytes(data))
            self.flush()
            return
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Send what is held now."""
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.writelines(held)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self.flush()  # what was written before close goes out first, as with any transport
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._held = []
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()


class CoalescingHttp(asyncio.Protocol):
    """uvicorn's `HttpToolsProtocol` on a `CoalescingTransport`: the protocol class of
    every ctxcache service (`uvicorn.Config(http=CoalescingHttp)`)."""

    def __init__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.http = HttpToolsProtocol(
            config=config, server_state=server_state, app_state=app_state, _loop=_loop
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports have asyncio.Transport's methods without being its subclass)
        real = cast(asyncio.Transport, transport)
        coalescing = CoalescingTransport(real, asyncio.get_running_loop())
        self.http.connection_made(coalescing)

    def connection_lost(self, exc: Exception | None) -> None:
        self.http.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.http.data_received(data)

    def eof_received(self) -> bool | None:
        return self.http.eof_received()

    def pause_writing(self) -> None:
        self.http.pause_writing()

    def resume_writing(self) -> None:
        self.http.resume_writing()
