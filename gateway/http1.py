"""A small keep-alive HTTP/1.1 client for the gateway's calls to one worker.

Every session turn makes two plain JSON calls to a worker (`/tokenize`, then the
completion), every request without a session one, and every stream one long call.
aiohttp's per-request machinery (request/response objects, tracing hooks, cookie and
redirect handling) was the largest part of the gateway's own CPU on them
(docs/benchmarks.md). This client does only what these calls need: `POST` with a body, a
response with `Content-Length`, chunked, or until close, read whole (`post`) or as it
arrives (`stream`), idle connections kept for reuse. Health checks, and workers behind
https or a path prefix, use aiohttp.

Failures: a connection that cannot be opened, or that ends before a whole response,
raises `ConnectionLost` (the caller treats the worker as down: nothing was answered); an
idle connection the worker closed meanwhile is replaced once, transparently. A whole call
is bounded by `request_timeout_s` (`TimeoutError`), a stream included: one timer per call
aborts its connection when the time is up (cheaper than an `asyncio.timeout` around every
read, which was a tenth of the gateway's CPU on a plain request).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]
READ_SIZE = 1 << 16
_LOST = (OSError, asyncio.IncompleteReadError, ValueError)


class ConnectionLost(Exception):
    """The worker could not be reached, or went away before a whole response."""


class Http1Pool:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float,
        request_timeout_s: float,
        max_idle: int = 64,
    ) -> None:
        self.host, self.port = host, port
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_idle = max_idle
        self._idle: list[Conn] = []
        self._host_header = f"Host: {host}:{port}\r\n".encode()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """`POST path` with a JSON body: the status and the whole response body."""
        response = await self._open(path, body)
        return response.status, await response.read()

    async def stream(self, path: str, body: bytes) -> Response:
        """`POST path` with a JSON body, once the answer's head is in: read its body as it
        arrives with `Response.chunks`, and `close` it when done with it."""
        return await self._open(path, body)

    def request(self, path: str, body: bytes) -> bytes:
        """`POST path` with a JSON body, as bytes to write on a connection to the worker."""
        return b"".join(
            (
                b"POST ",
                path.encode(),
                b" HTTP/1.1\r\n",
                self._host_header,
                b"Content-Type: application/json\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n\r\n",
                body,
            )
        )

    async def _open(self, path: str, body: bytes) -> Response:
        """Send the request and read the answer's head, on an idle connection if there is one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        request = self.request(path, body)
        while True:
            reused = bool(self._idle)
            conn = self._idle.pop() if reused else await self._connect()
            expiry = Expiry(conn, loop, deadline)
            try:
                conn[1].write(request)
                head = await conn[0].readuntil(b"\r\n\r\n")
                return Response(self, conn, head, expiry)
            except _LOST as exc:
                expiry.cancel()
                _close(conn)
                if expiry.fired:
                    raise TimeoutError() from exc
                if reused and _nothing_read(exc):
                    continue  # the worker closed this idle connection: take another
                raise ConnectionLost(type(exc).__name__) from exc
            except BaseException:  # cancellation mid-exchange: state unknown
                expiry.cancel()
                _close(conn)
                raise

    async def _connect(self) -> Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                return await asyncio.open_connection(self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect: {type(exc).__name__}") from exc

    def _give_back(self, conn: Conn) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            _close(conn)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)


class Expiry:
    """A call's deadline: when it passes, the call's connection is aborted, and what was
    waiting on it fails (and is reported as `TimeoutError`, since `fired` is set)."""

    __slots__ = ("conn", "fired", "handle")

    def __init__(self, conn: Conn, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        self.conn = conn
        self.fired = False
        self.handle = loop.call_at(deadline, self._fire)

    def _fire(self) -> None:
        self.fired = True
        self.conn[1].transport.abort()

    def cancel(self) -> None:
        self.handle.cancel()


class Response:
    """A worker's answer whose head is read. Its connection goes back to the pool once
    the whole body is read; `close` before that drops the connection (the worker sees the
    client go and stops generating)."""

    def __init__(self, pool: Http1Pool, conn: Conn, head: bytes, expiry: Expiry) -> None:
        self._pool: Http1Pool | None = pool
        self._conn = conn
        self._expiry = expiry
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split(b" ", 2)[1])
        self.length: int | None = None
        self.chunked = False
        self.keep = not lines[0].startswith(b"HTTP/1.0")
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()
            elif name == b"connection":
                self.keep = value.strip().lower() != b"close"
        if not self.chunked and self.length is None:  # the body runs to the end of the connection
            self.keep = False

    async def read(self) -> bytes:
        """The whole body."""
        if self.chunked or self.length is None:
            return b"".join([part async for part in self.chunks()])
        try:  # the usual JSON answer
            body = await self._conn[0].readexactly(self.length)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._release()
        return body

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, the chunked framing removed: what one read from the
        socket brought, in one piece (a worker's SSE events written back to back come out
        together). `ConnectionLost` if the connection ends first."""
        return self._chunked(Dechunker()) if self.chunked else self._unframed()

    def framed(self) -> AsyncIterator[bytes]:
        """A chunked body as it arrives with its framing kept, up to (not including) the
        last, empty chunk: what a relay whose own server writes that last chunk passes on
        untouched (`ChunkScanner`)."""
        return self._chunked(ChunkScanner())

    async def _chunked(self, decoder: Dechunker | ChunkScanner) -> AsyncIterator[bytes]:
        """A chunked body, each read through `decoder`."""
        reader = self._conn[0]
        try:
            while not decoder.done:
                data = await reader.read(READ_SIZE)
                if not data:
                    raise asyncio.IncompleteReadError(b"", None)
                if out := decoder.feed(data):
                    yield out
            self.keep = self.keep and decoder.clean
        except BaseException as exc:
            self._fail(exc)
            raise
        self._release()

    async def _unframed(self) -> AsyncIterator[bytes]:
        """A body of `Content-Length` bytes, or one that runs to the end of the connection."""
        reader = self._conn[0]
        try:
            if self.length is not None:
                left = self.length
                while left:
                    data = await reader.read(min(left, READ_SIZE))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:
                while data := await reader.read(READ_SIZE):
                    yield data
        except BaseException as exc:
            self._fail(exc)
            raise
        self._release()

    def _fail(self, exc: BaseException) -> None:
        """Reading the body failed: drop the connection; `TimeoutError` if its deadline
        passed, `ConnectionLost` if it was lost."""
        self.close()
        if isinstance(exc, _LOST):
            if self._expiry.fired:
                raise TimeoutError() from exc
            raise ConnectionLost(type(exc).__name__) from exc

    def _release(self) -> None:
        """The body is read: the connection may serve the next call."""
        pool, self._pool = self._pool, None
        if pool is not None:
            self._expiry.cancel()
            if self.keep:
                pool._give_back(self._conn)
            else:
                _close(self._conn)

    def close(self) -> None:
        """Done with this answer: a connection whose body was not read whole is closed."""
        if self._pool is not None:
            self._pool = None
            self._expiry.cancel()
            _close(self._conn)


class Dechunker:
    """Undoes `Transfer-Encoding: chunked` on bytes fed as they arrive."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._size: int | None = None  # of the chunk being read; None: its size line is next
        self._trailers = False  # past the last chunk: trailer lines up to an empty one
        self.done = False
        self.clean = True  # False if bytes followed the end (the connection can't be reused)

    def feed(self, data: bytes) -> bytes:
        """The payload bytes completed by `data` (possibly none)."""
        buf = self._buf
        buf += data
        out: list[bytes] = []
        pos = 0
        while not self.done:
            if self._size is None or self._trailers:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                line, pos = bytes(buf[pos:eol]), eol + 2
                if self._trailers:
                    self.done = not line
                else:
                    self._size = int(line.split(b";", 1)[0], 16)  # ValueError: not chunked
                    self._trailers = self._size == 0
                continue
            end = pos + self._size
            if len(buf) < end + 2:
                break
            if buf[end : end + 2] != b"\r\n":
                raise ValueError("a chunk does not end with CRLF")
            out.append(bytes(buf[pos:end]))
            pos, self._size = end + 2, None
        del buf[:pos]
        if self.done and buf:
            self.clean = False
        return b"".join(out)


class ChunkScanner:
    """Follows `Transfer-Encoding: chunked` framing on bytes fed as they arrive, without
    undoing it: says which bytes to pass on as they are (all before the last chunk's size
    line) and when the body has ended. Chunk payloads are skipped over, not copied."""

    def __init__(self) -> None:
        self._held = b""  # the start of a line whose end has not arrived yet
        self._left = 0  # payload bytes of the current chunk still to come
        self._line_ends_chunk = False  # the next line is the CRLF after a chunk's payload
        self._last = False  # the last chunk's line is seen: trailer lines follow
        self.done = False
        self.clean = True  # False if bytes followed the end (the connection can't be reused)

    def feed(self, data: bytes) -> bytes:
        """The bytes to pass on, of those held back and `data`."""
        if self._held:
            data, self._held = self._held + data, b""
        n = len(data)
        pos = 0
        end = 0 if self._last else n  # where the bytes to pass on end
        while pos < n and not self.done:
            if self._left:
                step = min(self._left, n - pos)
                self._left -= step
                pos += step
                continue
            eol = data.find(b"\r\n", pos)
            if eol < 0:  # a line cut in two: hold it back until it is whole
                self._held = data[pos:]
                end = min(end, pos)
                break
            if self._line_ends_chunk:
                if eol != pos:
                    raise ValueError("a chunk does not end with CRLF")
                self._line_ends_chunk = False
            elif self._last:
                self.done = eol == pos  # an empty line ends the trailers
            else:
                size = int(data[pos:eol].split(b";", 1)[0], 16)  # ValueError: not chunked
                self._left, self._line_ends_chunk = size, size > 0
                if size == 0:
                    self._last = True
                    end = pos
            pos = eol + 2
        if self.done and pos < n:
            self.clean = False
        return data[:end]


def _nothing_read(exc: BaseException) -> bool:
    """The connection ended before any byte of the answer (a stale keep-alive)."""
    if isinstance(exc, asyncio.IncompleteReadError):
        return not exc.partial
    return isinstance(exc, ConnectionResetError | BrokenPipeError)


def _close(conn: Conn) -> None:
    with contextlib.suppress(Exception):
        conn[1].close()
