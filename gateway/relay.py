"""Streams without a session, relayed from the server protocol's callbacks.

A stream with no session is only routed: the worker's events go to the client as they
are. Through the ASGI app that still cost a task, a dozen coroutine frames, ASGI message
dicts and a watcher task per request before the first event went out, which doubled the
time to the first token against the worker alone (docs/benchmarks.md, "Gateway"). Here
the request is answered from the callbacks of the two connections, as a splice would be:

* the client's request, once its body is in (`ctxcache.http_server.EarlyAnswers`), is
  checked and routed exactly as `FastPath` does (key, model, `cache_salt`), and written to
  an idle keep-alive connection to the least-loaded worker;
* the worker's answer is parsed by httptools as it arrives: its head is replaced by ours,
  and what each read brought goes to the client in one write — a 200 in chunks as the
  worker framed it, anything else decoded and sent in chunks of ours (the head waits for
  the first event, at most `HEAD_HOLD_S`, so the client wakes once for both).

Whatever is not the plain case goes the regular way (`FastPath`, then the FastAPI app),
where it is validated and answered, errors included: a request this does not take (a bad
key, a session, a body to validate, no healthy worker for the model, a client waiting for
`100 Continue`, a body over 64 KiB), and one whose worker could not be reached or closed
before answering (nothing was written to the client yet; the regular path marks the worker
down and fails over). A worker's error answer becomes our error envelope, as on the regular
path; a deadline (`request_timeout_s`) that passes before the head is a `backend_timeout`,
after it the client's connection is cut (as on the regular path: a stream cannot change its
status once it started). A client that leaves closes the worker's connection, so the
worker stops generating for nobody; a slow client pauses reading from the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from http import HTTPStatus
from typing import Any

import httptools

from ctxcache.errors import BackendTimeout, CtxError, error_response
from ctxcache.http_server import Exchange
from gateway.auth import KeyRing, authorization
from gateway.completions.streams import SSE_HEADERS
from gateway.fastpath import FAST_PATHS, first_header, parse_body, routable
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.salt import CacheSalt
from gateway.upstream import worker_error


def _lines(headers: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [name + b": " + value + b"\r\n" for name, value in headers]


_CHUNKED = [*SSE_HEADERS, (b"transfer-encoding", b"chunked")]
_HEAD = b"HTTP/1.1 200 OK\r\n" + b"".join(_lines(_CHUNKED))
_MAX_IDLE = 64  # idle connections kept per worker
HEAD_HOLD_S = 0.05  # how long a head waits for the first event, to go out with it
log = logging.getLogger(__name__)


class StreamRelay:
    """`EarlyAnswers` for the gateway: streams without a session (see the module)."""

    def __init__(self, metrics: GatewayMetrics, *, max_body_bytes: int) -> None:
        self.metrics = metrics
        self.routing: tuple[KeyRing, WorkerPool, CacheSalt] | None = None  # (`start`)
        self.max_body_bytes = max_body_bytes
        self._idle: dict[str, list[Upstream]] = {}  # worker id -> idle connections
        self._ok_head: tuple[object, bytes] = (None, b"")  # (server headers, head)

    def wants(self, scope: dict[str, Any]) -> bool:
        return scope["method"] == "POST" and scope["path"] in FAST_PATHS

    def start(self, keys: KeyRing, pool: WorkerPool, salt: CacheSalt) -> None:
        """Take streams from now on, routed with these (the app's lifespan makes them)."""
        self.routing = (keys, pool, salt)

    def take(self, exchange: Exchange, body: bytes) -> bool:
        if self.routing is None or len(body) > self.max_body_bytes:
            return False
        keys, pool, salt = self.routing
        scope = exchange.scope
        headers = scope["headers"]
        try:
            tenant = keys.tenant_for(authorization(headers))
        except CtxError:
            return False
        if first_header(headers, b"x-session-id") is not None:
            return False
        doc = parse_body(body)
        if doc is None or doc.get("stream") is not True or not routable(doc):
            return False
        try:
            worker = pool.pick(doc["model"])
            body = salt.salted(tenant, doc, body)
        except CtxError:  # no worker for the model, a bad cache_salt: the regular path says
            return False
        if worker.fast is None:  # https or a path prefix: aiohttp's
            return False
        _Stream(self, exchange, worker, scope["path"], body).start()
        self.metrics.relayed_streams.inc()
        return True

    def ok_head(self, exchange: Exchange) -> bytes:
        """The head of a relayed stream (the same for every stream while the server's
        own headers, date included, stay the same)."""
        server = exchange.default_headers
        if not exchange.keep_alive:
            return _head(_HEAD, server, keep_alive=False)
        if server is not self._ok_head[0]:
            self._ok_head = (server, _head(_HEAD, server, keep_alive=True))
        return self._ok_head[1]

    def idle(self, worker: Worker) -> list[Upstream]:
        return self._idle.setdefault(worker.id, [])

    def close(self) -> None:
        """Close the idle connections (at shutdown)."""
        idle, self._idle = self._idle, {}
        for upstreams in idle.values():
            for upstream in upstreams:
                upstream.close()


class _Stream:
    """One relayed stream, from the request to its last chunk."""

    __slots__ = (
        "body_sent",
        "connecting",
        "deadline",
        "done",
        "error",
        "exchange",
        "fast",
        "head_timer",
        "loop",
        "out",
        "path",
        "relay",
        "request",
        "status",
        "t0",
        "upstream",
        "worker",
        "write",
    )

    def __init__(
        self, relay: StreamRelay, exchange: Exchange, worker: Worker, path: str, body: bytes
    ) -> None:
        self.t0 = time.perf_counter()
        self.relay, self.exchange, self.worker, self.path = relay, exchange, worker, path
        fast = worker.fast
        assert fast is not None
        self.fast = fast
        self.request = fast.request(path, body)
        self.write = exchange.transport.write_now  # to the client, at once
        self.upstream: Upstream | None = None
        self.connecting: asyncio.Task[None] | None = None
        self.status = 0  # the worker's, once its head is in
        self.error = b""  # the body of an error answer
        self.out: list[bytes] = []  # for the client, from the read being parsed
        self.body_sent = False  # ... (and whether anything went out yet)
        self.head_timer: asyncio.TimerHandle | None = None
        self.done = False

    @property
    def started(self) -> bool:
        """The worker's head was a 200: ours is written (or held for its first event)."""
        return self.status == 200

    def start(self) -> None:
        """Write the request to the worker (on an idle connection: at once), then set up
        the rest: the worker starts on it meanwhile."""
        idle = self.relay.idle(self.worker)
        while idle:
            upstream = idle.pop()
            if not upstream.transport.is_closing():
                self._send(upstream)
                break
        self.loop = loop = asyncio.get_running_loop()
        if self.upstream is None:
            self.connecting = loop.create_task(self._connect())
        self.deadline = loop.call_later(self.fast.request_timeout_s, self._timed_out)
        self.worker.inflight += 1
        self.exchange.on_client_left = self._client_left
        self.exchange.on_writable = self._writable

    async def _connect(self) -> None:
        try:
            async with asyncio.timeout(self.fast.connect_timeout_s):
                _, upstream = await self.loop.create_connection(
                    lambda: Upstream(self.relay, self.worker), self.fast.host, self.fast.port
                )
        except (OSError, TimeoutError):
            self._to_app()  # the regular path fails over (or says the worker is down)
            return
        finally:
            self.connecting = None
        if self.done:  # the client left meanwhile
            upstream.close()
            return
        self._send(upstream)

    def _send(self, upstream: Upstream) -> None:
        self.upstream = upstream
        upstream.stream = self
        upstream.transport.write(self.request)

    # the worker's answer (`Upstream`'s parser callbacks)

    def head(self, status: int) -> None:
        self.status = status
        if status != 200:
            return  # an error: its body is read whole (`body`, `end`)
        self.out.append(self.relay.ok_head(self.exchange))

    def body(self, data: bytes) -> None:
        """Part of the answer's body, decoded (not for chunks passed on as they are)."""
        if not self.started:
            self.error += data
        else:
            self.out.append(b"%x\r\n%b\r\n" % (len(data), data))

    def chunks(self, data: bytes, ended: bool | None) -> None:
        """The worker's chunks as they came (framing included, its last chunk too): they
        go on unchanged. `ended`: the answer is complete (and its connection kept alive
        or not)."""
        if ended is None and self.body_sent and not self.done:  # the usual: the next event
            self.write(data)
            if self.exchange.flow.write_paused:
                self._pause()
            return
        if data:
            self.out.append(data)
        if ended is None:
            self.read_done()
        else:
            self.end(ended, passed=True)

    def read_done(self) -> None:
        """What one read from the worker brought is relayed: in one write to the client.
        A head with no event yet waits for the first event (a client wakes once for
        both), at most `HEAD_HOLD_S` (a long prefill must not hold the head back)."""
        if len(self.out) == 1 and not self.body_sent:
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(HEAD_HOLD_S, self._flush)
            return
        if self.out:
            self._flush()

    def _flush(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.body_sent = True
        out, self.out = self.out, []
        if not out or self.done:
            return
        self.write(b"".join(out))
        if self.exchange.flow.write_paused:
            self._pause()

    def _pause(self) -> None:
        """The client is not keeping up: read no more from the worker until it does."""
        if self.upstream is not None:
            self.upstream.transport.pause_reading()

    def end(self, keep_alive: bool, *, passed: bool = False) -> None:
        """The worker's answer is complete (`passed`: its chunks were passed on as they
        came, its last one included)."""
        upstream = self.upstream
        assert upstream is not None
        upstream.stream = None
        idle = self.relay.idle(self.worker)
        if keep_alive and len(idle) < _MAX_IDLE:
            idle.append(upstream)
        else:
            upstream.close()
        if self.started:
            if not passed:
                self.out.append(b"0\r\n\r\n")  # (else the worker's last chunk was passed on)
            self._flush()
            self._finish(self.exchange.finish)
        else:
            self._answer_error(worker_error(self.status, bytes(self.error)))

    def upstream_lost(self) -> None:
        """The worker's connection closed (or sent what is not HTTP) before its answer
        was complete."""
        if self.done:
            return
        if not self.started:
            # nothing was written to the client: the regular path takes the request (a
            # reused connection the worker had closed; or the worker is down, and that
            # path marks it down and fails over)
            self._to_app()
            return
        log.warning("worker %s closed a stream mid-answer: the client's is cut", self.worker.id)
        self._finish(self.exchange.abort)

    # the client

    def _client_left(self) -> None:
        if self.done:
            return
        self._drop_worker()  # the worker stops generating for nobody
        self._finish(lambda: None)

    def _writable(self) -> None:
        if self.upstream is not None and not self.done:
            self.upstream.transport.resume_reading()

    def _timed_out(self) -> None:
        if self.done:
            return
        self._drop_worker()
        if self.started:
            log.warning("worker %s: a stream ran past the request timeout", self.worker.id)
            self._finish(self.exchange.abort)
        else:
            self._answer_error(BackendTimeout())

    # ends

    def _answer_error(self, exc: CtxError) -> None:
        response = error_response(exc)
        self.status = response.status_code
        status = b"HTTP/1.1 %d %b\r\n" % (response.status_code, _reason(response.status_code))
        head = _head(
            status + b"".join(_lines(response.raw_headers)),
            self.exchange.default_headers,
            keep_alive=self.exchange.keep_alive,
        )
        self.exchange.transport.write(head + response.body)
        self._finish(self.exchange.finish)

    def _to_app(self) -> None:
        self._drop_worker()
        self._finish(self.exchange.to_app, observe=False)

    def _drop_worker(self) -> None:
        """Stop whatever is under way with the worker: a connect, or its answer."""
        if self.connecting is not None:
            self.connecting.cancel()
        if self.upstream is not None:
            self.upstream.stream = None
            self.upstream.close()

    def _finish(self, end: Any, *, observe: bool = True) -> None:
        self.done = True
        self.deadline.cancel()
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.worker.inflight -= 1
        if observe:
            self.relay.metrics.observe(self.path, self.status or 200, time.perf_counter() - self.t0)
        end()


class Upstream(asyncio.Protocol):
    """A keep-alive connection to a worker; the answer to each request written on it goes
    to the `_Stream` that wrote it."""

    def __init__(self, relay: StreamRelay, worker: Worker) -> None:
        self.relay, self.worker = relay, worker
        self.stream: _Stream | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport
        # the answer being read:
        self.framed = False  # it has a length or chunks (else it ends with the connection)
        self.chunked = False  # ... chunks: a 200's go to the client as they are (`passing`)
        self.head = bytearray()  # what was read of its head, when that took more than one read
        self.in_head = False  # its head is being read
        self.passing = False  # its body goes on as it came (`_Stream.chunks`)
        self.ended: bool | None = None  # while passing: complete (keep-alive or not)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        if self.passing:  # more of a 200's chunks: on as they came
            if self._feed(data):
                self._pass_on(data)
            return
        if not self._feed(data):
            return
        if self.in_head:  # the rest of the head comes in the next read
            self.head += data
            return
        if self.head:  # the head came in more than one read
            data, self.head = bytes(self.head + data), bytearray()
        if self.stream is None:
            return
        if self.passing:  # this read completed a 200's head: its chunks follow it
            self._pass_on(data[data.find(b"\r\n\r\n") + 4 :])
        else:
            self.stream.read_done()

    def _feed(self, data: bytes) -> bool:
        """Parse `data` (False: it is not HTTP, and the connection is closed)."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()
            self._lost()
            return False
        return True

    def _pass_on(self, data: bytes) -> None:
        stream = self.stream
        assert stream is not None
        ended = self.ended
        if ended is not None:  # the answer is complete: the next one is read afresh
            self.passing, self.ended = False, None
        stream.chunks(data, ended)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()

    def _lost(self) -> None:
        idle = self.relay.idle(self.worker)
        if self in idle:
            idle.remove(self)
        stream, self.stream = self.stream, None
        if stream is None:
            return
        if stream.status and not self.framed:  # a body that ends with the connection: whole
            stream.end(keep_alive=False)
        else:
            stream.upstream_lost()

    def close(self) -> None:
        self.transport.close()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.framed = self.chunked = self.passing = False
        self.in_head = True
        self.ended = None

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"transfer-encoding":
            self.framed = True
            self.chunked = value.strip().lower() == b"chunked"
        elif name == b"content-length":
            self.framed = True

    def on_headers_complete(self) -> None:
        self.in_head = False
        if self.stream is not None:
            status = self.parser.get_status_code()
            self.passing = status == 200 and self.chunked
            self.stream.head(status)

    def on_body(self, body: bytes) -> None:
        if self.stream is not None and not self.passing:
            self.stream.body(body)

    def on_message_complete(self) -> None:
        keep_alive = self.parser.should_keep_alive()
        if self.passing:
            self.ended = keep_alive  # ended once its last bytes are passed on (`data_received`)
        elif self.stream is not None:
            self.stream.end(keep_alive)


def _head(start: bytes, server: list[tuple[bytes, bytes]], *, keep_alive: bool) -> bytes:
    """An answer's head: `start` (its status line and own headers), then the server's."""
    head = [start, *_lines(server)]
    if not keep_alive:
        head.append(b"connection: close\r\n")
    head.append(b"\r\n")
    return b"".join(head)


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""
