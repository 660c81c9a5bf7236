"""A small keep-alive HTTP/1.1 client for the gateway's JSON calls to one worker.

Every session turn makes two plain JSON calls to a worker (`/tokenize`, then the
completion) and every request without a session one; aiohttp's per-request machinery
(request/response objects, tracing hooks, cookie and redirect handling) was the largest
part of the gateway's own CPU on them (docs/benchmarks.md). This client does only what
these calls need: `POST` with a body, a response with `Content-Length` or chunked, idle
connections kept for reuse. Streams and health checks still use aiohttp.

Failures: a connection that cannot be opened, or that ends before a whole response,
raises `ConnectionLost` (the caller treats the worker as down: nothing was answered); an
idle connection the worker closed meanwhile is replaced once, transparently. A whole call
is bounded by `request_timeout_s` (`TimeoutError`).
"""

from __future__ import annotations

import asyncio
import contextlib

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


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
        head = b"".join(
            (
                b"POST ",
                path.encode(),
                b" HTTP/1.1\r\n",
                self._host_header,
                b"Content-Type: application/json\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n\r\n",
            )
        )
        async with asyncio.timeout(self.request_timeout_s):
            while True:
                reused = bool(self._idle)
                conn = self._idle.pop() if reused else await self._connect()
                try:
                    status, payload, keep = await _exchange(conn, head + body)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    _close(conn)
                    if reused and _nothing_read(exc):
                        continue  # the worker closed this idle connection: take another
                    raise ConnectionLost(type(exc).__name__) from exc
                except BaseException:  # timeout or cancellation mid-exchange: state unknown
                    _close(conn)
                    raise
                if keep and len(self._idle) < self.max_idle:
                    self._idle.append(conn)
                else:
                    _close(conn)
                return status, payload

    async def _connect(self) -> Conn:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                return await asyncio.open_connection(self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise ConnectionLost(f"cannot connect: {type(exc).__name__}") from exc

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            _close(conn)


async def _exchange(conn: Conn, request: bytes) -> tuple[int, bytes, bool]:
    reader, writer = conn
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length: int | None = None
    chunked, keep = False, not lines[0].startswith(b"HTTP/1.0")
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            keep = value.strip().lower() != b"close"
    if chunked:
        return status, await _read_chunked(reader), keep
    if length is None:  # neither: the body runs to the end of the connection
        return status, await reader.read(), False
    return status, await reader.readexactly(length), keep


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, if any
                pass
            return b"".join(parts)
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)


def _nothing_read(exc: BaseException) -> bool:
    """The connection ended before any byte of the answer (a stale keep-alive)."""
    if isinstance(exc, asyncio.IncompleteReadError):
        return not exc.partial
    return isinstance(exc, ConnectionResetError | BrokenPipeError)


def _close(conn: Conn) -> None:
    with contextlib.suppress(Exception):
        conn[1].close()
