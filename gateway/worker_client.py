"""The gateway's one HTTP client for its workers: keep-alive HTTP/1.1 on asyncio + httptools.

Every call to a worker goes through here: health checks, `/tokenize`, plain and streamed
completions, with a session or without. A `WorkerClient` per worker keeps idle
connections for reuse; `request` writes a request and returns once the answer's head is
in (`Answer`); its body is read whole (`Answer.read`) or as it arrives (`Answer.chunks`:
what one socket read brought, in one piece).

Framing is httptools' (llhttp, strict): an answer with two `Content-Length`s, or with
`Content-Length` and `Transfer-Encoding`, or that is not HTTP, fails the call
(`Misframed`) and its connection is closed, never pooled. So is a connection on which the
worker sends anything it was not asked for (bytes after the end of an answer, in the same
read or later): the answer that ended is whole and is delivered; the connection is not
reused, so those bytes can never be read as the next caller's answer.

Failures: a connection that cannot be opened, or that ends before a whole answer, raises
`ConnectionLost` (the caller may treat the worker as down); an idle connection the worker
closed meanwhile is replaced once, transparently. A call, a stream included, is bounded by
`request_timeout_s`: when it passes, the connection is aborted and the call raises
`TimeoutError`. A reader that falls behind pauses reading from the worker (so a slow
client slows the worker's stream instead of filling the gateway's memory); the pause
belongs to the answer, and a connection goes back to the pool only once its answer is
complete and reading is resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

import httptools

from gateway.tracing import outgoing_headers

HIGH_WATER = 1 << 16  # bytes of an answer's body held for a slow reader before pausing
Headers = Iterable[tuple[bytes, bytes]]


class ConnectionLost(Exception):
    """The worker could not be reached, or went away before a whole answer."""


class Misframed(Exception):
    """The worker's answer is not HTTP we can trust (its framing is ambiguous or broken)."""


class WorkerClient:
    """Keep-alive HTTP/1.1 to one worker (`http://host:port[/prefix]`, or https)."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float,
        request_timeout_s: float,
        max_idle: int = 64,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/").encode()
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        host = self.host if parts.port is None else f"{self.host}:{self.port}"
        self._head = b"\r\nHost: " + host.encode() + b"\r\n"

    async def post(self, path: str, body: bytes, *, headers: Headers = ()) -> tuple[int, bytes]:
        """`POST path` with a JSON body: the status and the whole body."""
        answer = await self.request("POST", path, body, headers=headers)
        return answer.status, await answer.read()

    async def get(self, path: str, *, timeout_s: float | None = None) -> tuple[int, bytes]:
        answer = await self.request("GET", path, timeout_s=timeout_s)
        return answer.status, await answer.read()

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        headers: Headers = (),
        timeout_s: float | None = None,
    ) -> Answer:
        """Send a request; return once the answer's head is in. The caller reads its body
        or closes it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.request_timeout_s)
        data = self._encode(method, path, body, headers)
        while True:
            conn = self._take_idle()
            reused = conn is not None
            if conn is None:
                conn = await self._connect(deadline - loop.time())
            answer = conn.send(data, deadline)
            try:
                await answer.head()
                return answer
            except ConnectionLost:
                if reused and not answer.got_bytes:
                    continue  # the worker had closed this idle connection: take another
                raise
            except BaseException:
                answer.close()
                raise

    def _encode(self, method: str, path: str, body: bytes, headers: Headers) -> bytes:
        lines = [method.encode(), b" ", self.prefix, path.encode(), b" HTTP/1.1", self._head]
        for name, value in (*headers, *outgoing_headers()):  # + the trace's, when on
            lines += (name, b": ", value, b"\r\n")
        if method != "GET" or body:
            lines += (b"Content-Type: application/json\r\nContent-Length: ", b"%d" % len(body))
            lines.append(b"\r\n")
        lines += (b"\r\n", body)
        return b"".join(lines)

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, time_left: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(min(self.connect_timeout_s, max(time_left, 0))):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self.ssl
                )
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect: {type(exc).__name__}") from exc
        return conn

    def give_back(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle and not conn.transport.is_closing():
            self._idle.append(conn)
        else:
            conn.transport.close()

    def forget(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.transport.close()


class Answer:
    """A worker's answer to one request: its head, then its body as it arrives."""

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self._expiry: asyncio.TimerHandle | None = None  # (`expire_at`)
        self._waiter: asyncio.Future[None] | None = None
        self._pending: list[bytes] = []
        self._pending_size = 0
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.has_head = False
        self.done = False  # the whole body is in
        self.error: BaseException | None = None
        self.got_bytes = False  # anything of the answer arrived

    async def head(self) -> None:
        while not self.has_head:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([part async for part in self.chunks()])

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; `ConnectionLost` (or `TimeoutError`) if it breaks off."""
        try:
            while True:
                if self._pending:
                    data = b"".join(self._pending)
                    self._pending.clear()
                    self._pending_size = 0
                    if self._conn is not None:
                        self._conn.transport.resume_reading()
                    yield data
                elif self.done:
                    return
                elif self.error is not None:
                    raise self.error
                else:
                    await self._wait()
        finally:
            if not self.done:
                self.close()

    def expire_at(self, deadline: float) -> None:
        """Fail the call (and drop its connection) if it is not over by `deadline`."""
        self._expiry = asyncio.get_running_loop().call_at(deadline, self._expire)

    def close(self) -> None:
        """Done with this answer: if its body is not whole yet, its connection is dropped
        (the worker sees the caller leave, and stops generating)."""
        self._stop_expiry()
        conn, self._conn = self._conn, None
        if conn is not None and not self.done:
            conn.transport.abort()

    # from the connection

    def body(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_size += len(data)
        if self._pending_size > HIGH_WATER and self._conn is not None:
            self._conn.transport.pause_reading()  # until the reader catches up (`chunks`)

    def end(self) -> None:
        self.done = True
        self._stop_expiry()
        self._conn = None
        self.wake()

    def fail(self, error: BaseException) -> None:
        if self.done or self.error is not None:
            return
        self.error = error
        self._stop_expiry()
        self._conn = None
        self.wake()

    def _stop_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()

    def _expire(self) -> None:
        conn = self._conn
        self.fail(TimeoutError("the worker took longer than the request timeout"))
        if conn is not None:
            conn.transport.abort()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        """Wake the reader waiting for more of the answer (its connection calls this when
        the head or more of the body is in)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One connection to a worker, carrying one answer at a time."""

    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport
        self.answer: Answer | None = None
        self.framed = False  # the answer has a length or chunks (else it ends with the connection)
        self.unasked = False  # the worker sent a message nobody asked for: never reuse
        self.keep_alive = False  # of the last whole answer (the parser's, read as it ends)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, deadline: float) -> Answer:
        answer = self.answer = Answer(self)
        self.framed = False
        self.transport.write(request)  # first: the worker starts on it meanwhile
        answer.expire_at(deadline)
        return answer

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:  # bytes while idle: nothing was asked
            self.unasked = True
            self.transport.abort()
            return
        answer.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.unasked = True
            answer.fail(Misframed(f"the worker's answer is not valid HTTP: {exc}"))
            self.transport.abort()
            if answer.done:
                self._finished()
            return
        if answer.done:
            self._finished()
        else:
            answer.wake()

    def _finished(self) -> None:
        """The answer is whole: the connection serves the next call, unless it cannot."""
        self.answer = None
        self.transport.resume_reading()  # (a pause was the answer's: it is over)
        if self.unasked or not self.keep_alive:
            self.transport.close()
        else:
            self.client.give_back(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.forget(self)
        answer, self.answer = self.answer, None
        if answer is None or answer.done:
            return
        if answer.has_head and not self.framed:  # a body that ends with the connection
            answer.end()
            return
        reason = type(exc).__name__ if exc else "closed"
        answer.fail(ConnectionLost(f"the worker closed the connection mid-answer ({reason})"))

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self.answer is None or self.answer.has_head:
            self.unasked = True  # a second answer to one request

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.unasked or self.answer is None:
            return
        lower = name.lower()
        if lower in (b"content-length", b"transfer-encoding"):
            self.framed = True
        self.answer.headers.append((lower, value))

    def on_headers_complete(self) -> None:
        answer = self.answer
        if self.unasked or answer is None:
            return
        answer.status = self.parser.get_status_code()
        answer.has_head = True
        answer.wake()

    def on_body(self, body: bytes) -> None:
        if not self.unasked and self.answer is not None:
            self.answer.body(body)

    def on_message_complete(self) -> None:
        if not self.unasked and self.answer is not None:
            self.keep_alive = self.parser.should_keep_alive()
            self.answer.end()
