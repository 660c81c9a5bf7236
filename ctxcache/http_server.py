"""uvicorn's httptools protocol, with the writes of one event-loop turn sent together.

uvicorn writes a response's head, each body part and a chunked stream's end marker with a
`transport.write` each, and each is a `send` of its own: a plain JSON answer goes out as
two TCP segments (the client wakes for the head, then again for the body), a streamed one
as one per event and more. Here the protocol's transport sends the writes of one event-loop
turn together (`CoalescingTransport`): head and body of a plain answer in one call, a
stream's head with its first events, and events that arrived together in one call.
docs/benchmarks.md, "Gateway (`ctxcache bench gateway`)", has what it saves.

An app may also answer some requests from the protocol's callbacks, with no ASGI task:
the requests its `early_answers` wants (`EarlyAnswers`) are held until their body is in
and offered to it first; what it does not take goes to the app as usual. The gateway
relays streams without a session this way (gateway/relay.py).

Every ctxcache service serves through it (`ctxcache.settings.serve_app`).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable
from typing import Any, Protocol

import httptools
from starlette.types import Scope
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


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

    def write_now(self, data: bytes) -> None:
        """Send `data` now (after what is held), not at the end of the turn: for a caller
        that gathered a turn's writes itself."""
        if self._transport.is_closing():
            return
        if self._held:
            held, self._held = self._held, []
            held.append(data)
            self._transport.writelines(held)
        else:
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self._flush()  # what was written before close goes out first, as with any transport
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class EarlyAnswers(Protocol):
    """What an app may offer the server as its `early_answers` attribute: requests it
    answers from the protocol's callbacks, without an ASGI task (`Exchange`)."""

    def wants(self, scope: Scope) -> bool:
        """Whether to offer this request to `take` once its body is in (its scope has the
        method, path and headers set; the rest may come later)."""
        ...

    def take(self, exchange: Exchange, body: bytes) -> bool:
        """Answer the request (True), or leave it to the ASGI app (False). The answer is
        written after `take` returns (from a later callback): the exchange may not know
        its keep-alive and the server's headers before."""
        ...


class Exchange:
    """One request an `EarlyAnswers` took: its scope, the connection to answer on, and the
    calls that end it. Until it writes, it may still hand the request to the ASGI app
    (`to_app`); once it wrote, it ends with `finish` or `abort`."""

    __slots__ = (
        "_app",
        "_cycle",
        "_protocol",
        "flow",
        "on_client_left",
        "on_writable",
        "scope",
        "transport",
    )

    def __init__(
        self, protocol: CoalescingHttpToolsProtocol, cycle: RequestResponseCycle | None, app: Any
    ) -> None:
        self._protocol, self._app = protocol, app
        self._cycle: RequestResponseCycle = cycle  # type: ignore[assignment]  # (None: see _offer_early)
        self.scope: Scope = protocol.scope  # type: ignore[assignment]
        self.transport: CoalescingTransport = protocol.transport  # type: ignore[assignment]
        # `flow.write_paused`: the client is not keeping up; stop reading what is to go to
        # it until `on_writable`
        self.flow: FlowControl = protocol.flow
        self.on_client_left: Callable[[], None] | None = None
        self.on_writable: Callable[[], None] | None = None  # the client caught up

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        """The server's own headers (date, server), for the answer's head."""
        return self._cycle.default_headers

    @property
    def keep_alive(self) -> bool:
        return self._cycle.keep_alive

    def write_now(self, data: bytes) -> None:
        """Write `data` to the client at once (`CoalescingTransport.write_now`)."""
        self.transport.write_now(data)

    def to_app(self) -> None:
        """Nothing was written: the ASGI app answers instead, as if this never took it."""
        self._protocol.exchange = None
        self._protocol.start_app(self._cycle, self._app)

    def finish(self) -> None:
        """The answer is written whole: the connection serves the next request (or closes,
        if it is not kept alive), as after an ASGI answer."""
        protocol = self._protocol
        protocol.exchange = None
        self._cycle.response_complete = True
        self._cycle.message_event.set()
        if not self._cycle.keep_alive:
            self.transport.close()
        protocol.on_response_complete()

    def abort(self) -> None:
        """The answer cannot be completed: the client's connection is closed (so the
        client sees a cut answer, never a complete-looking one)."""
        self._protocol.exchange = None
        self._cycle.response_complete = True
        self.transport.close()


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `CoalescingTransport`, which each request's scope
    names under `extensions[RAW_BODY]["transport"]` (see `raw_transport`); and, if the
    app offers `early_answers`, the requests it wants go there first (`EarlyAnswers`).

    A wanted request that arrives while the connection answers nothing else is offered
    before uvicorn makes its request-response cycle (`_early_body`): the cycle, made after
    the offer, costs nothing on the way to an answer that starts within the offer (the
    relay's write to a worker). Otherwise (a pipelined request) the request's task is held
    until its body is in, and then offered (`_held`)."""

    exchange: Exchange | None = None  # the request an `EarlyAnswers` is answering
    _held: tuple[RequestResponseCycle, Any] | None = None  # a task held for its body
    _early_body: bytearray | None = None  # the body of a wanted request with no cycle yet
    _cycle_only = False  # uvicorn's on_headers_complete makes the cycle, starts no task

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        coalescing = CoalescingTransport(transport, asyncio.get_running_loop())
        super().connection_made(coalescing)  # type: ignore[arg-type]
        self._early: EarlyAnswers | None = getattr(self.app, "early_answers", None)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {RAW_BODY: {"transport": self.transport}}

    def on_headers_complete(self) -> None:
        early = self._early
        if (
            early is not None
            and (self.cycle is None or self.cycle.response_complete)  # none being answered
            and not self.expect_100_continue  # (the client waits for the app to read)
            and self.limit_concurrency is None  # (uvicorn may answer 503 itself)
            and not self.parser.should_upgrade()
            and early.wants(self._early_scope())
        ):
            self._early_body = bytearray()  # offered once in (`on_message_complete`)
        else:
            super().on_headers_complete()

    def _early_scope(self) -> Scope:
        """The scope's method and path, as uvicorn's `on_headers_complete` sets them."""
        scope = self.scope
        scope["method"] = self.parser.get_method().decode("ascii")
        path = httptools.parse_url(self.url).path.decode("ascii")
        scope["path"] = self.root_path + (urllib.parse.unquote(path) if "%" in path else path)
        return scope  # type: ignore[return-value]

    def _make_cycle(self, body: bytes | bytearray, *, more_body: bool) -> RequestResponseCycle:
        """The request's cycle (uvicorn's `on_headers_complete`) with the body read so
        far; no task started."""
        self._cycle_only = True
        try:
            super().on_headers_complete()
        finally:
            self._cycle_only = False
        cycle = self.cycle
        cycle.body += body
        cycle.more_body = more_body
        cycle.message_event.set()
        return cycle

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if self._cycle_only:
            return
        if (
            self._early is None
            or app is not self.app  # (uvicorn's own answer: over its concurrency limit)
            or cycle.waiting_for_100_continue  # the client sends its body once the app reads
            or not self._early.wants(cycle.scope)
        ):
            super()._start_asgi_task(cycle, app)
        elif cycle.more_body:
            self._held = (cycle, app)  # until its body is in (`on_message_complete`)
        else:  # a pipelined request, read whole while the one before it was answered
            self._offer(cycle, app)

    def start_app(self, cycle: RequestResponseCycle, app: Any) -> None:
        super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        early_body = self._early_body
        if early_body is not None:
            early_body += body
            if len(early_body) > HIGH_WATER_LIMIT:  # too big to hold: the app reads it
                self._early_body = None
                self.start_app(self._make_cycle(early_body, more_body=True), self.app)
                self.flow.pause_reading()  # (as uvicorn's `on_body` would: until it reads)
            return
        super().on_body(body)
        if self._held is not None and len(self._held[0].body) > HIGH_WATER_LIMIT:
            held, self._held = self._held, None  # too big to hold: the app reads it
            self.start_app(*held)

    def on_message_complete(self) -> None:
        if self._early_body is not None:
            body, self._early_body = bytes(self._early_body), None
            self._offer_early(body)
            return
        super().on_message_complete()
        if self._held is not None:
            held, self._held = self._held, None
            self._offer(*held)

    def _offer_early(self, body: bytes) -> None:
        """Offer a request that has no cycle yet; make its cycle after the offer."""
        exchange = self.exchange = Exchange(self, None, self.app)
        taken = self._take(exchange, body)
        cycle = self._make_cycle(body, more_body=False)
        if taken:
            exchange._cycle = cycle
        else:
            self.exchange = None
            self.start_app(cycle, self.app)

    def _offer(self, cycle: RequestResponseCycle, app: Any) -> None:
        self.exchange = Exchange(self, cycle, app)
        if not self._take(self.exchange, bytes(cycle.body)):
            self.exchange = None
            self.start_app(cycle, app)

    def _take(self, exchange: Exchange, body: bytes) -> bool:
        """Offer the request to `early_answers`: whether it answers it."""
        assert self._early is not None
        try:
            return self._early.take(exchange, body)
        except Exception:  # a bug there must not leave the client waiting: the app answers
            log.exception("early answer failed on %s", exchange.scope["path"])
            return False

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        exchange, self.exchange = self.exchange, None
        if exchange is not None and exchange.on_client_left is not None:
            exchange.on_client_left()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self.exchange is not None and self.exchange.on_writable is not None:
            self.exchange.on_writable()


RAW_BODY = "ctxcache.raw_body"
log = logging.getLogger(__name__)


def raw_transport(scope: Scope) -> asyncio.Transport | None:
    """Where a response whose head declared `transfer-encoding: chunked` may write body
    bytes that are already in chunked framing, to go out as they are (a relay passes a
    worker's stream on this way); None when the app is not served by this protocol (tests
    that call it in process). The response still ends with an ASGI body message with
    `more_body: False`, which writes the last chunk."""
    extension = scope.get("extensions", {}).get(RAW_BODY)
    return None if extension is None else extension["transport"]  # type: ignore[no-any-return]
