"""A minimal HTTP/1.1 keep-alive load generator (one connection per concurrent client).

General clients (httpx, aiohttp) cost more per request than the servers being measured;
this one writes pre-built request bytes and reads `Content-Length` or chunked responses
(a stream: the time to its first chunk is its TTFT). Where `wrk` is installed the gateway
bench measures plain and streaming requests with it instead (`benchmarks.gateway.wrk`: C, several
times cheaper per request); this generator stays for what wrk cannot do there — a session
per connection, TTFT — and is the fallback when wrk is missing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

READ_SIZE = 1 << 16


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)  # seconds, whole responses
    ttfts: list[float] = field(default_factory=list)  # seconds to the first body bytes
    seconds: float = 0.0
    errors: int = 0


class Conn:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str
    ) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> Conn:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    def build(
        self,
        method: str,
        path: str,
        body: object | None = None,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        payload = orjson.dumps(body) if body is not None else b""
        lines = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self.host}",
            f"Content-Length: {len(payload)}",
            "Content-Type: application/json",
        ]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload

    async def send(self, request: bytes) -> tuple[int, bytes, float]:
        """(status, body, perf_counter time its first body bytes arrived)."""
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length == 0 and b"chunked" in head.lower():
            return status, *await self._chunked()
        body = await self.reader.readexactly(length) if length else b""
        return status, body, time.perf_counter()

    async def _chunked(self) -> tuple[bytes, float]:
        dechunk, parts, first = Dechunker(), [], 0.0
        while not dechunk.done:
            data = await self.reader.read(READ_SIZE)
            if not data:
                raise asyncio.IncompleteReadError(b"", None)
            if payload := dechunk.feed(data):
                first = first or time.perf_counter()
                parts.append(payload)
        return b"".join(parts), first or time.perf_counter()

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def run(
    host: str,
    port: int,
    make_request: Callable[[Conn, int], bytes],
    *,
    requests: int,
    concurrency: int,
    progress: Callable[[int], object] | None = None,
) -> LoadResult:
    """Send `requests` requests over `concurrency` connections."""
    conns = [await Conn.open(host, port) for _ in range(concurrency)]
    result = LoadResult()
    counter = iter(range(requests))

    async def client(conn: Conn) -> None:
        for i in counter:
            req = make_request(conn, i)
            t0 = time.perf_counter()
            status, _, first = await conn.send(req)
            result.latencies.append(time.perf_counter() - t0)
            result.ttfts.append(first - t0)
            if status >= 400:
                result.errors += 1
            if progress is not None:
                progress(1)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in conns))
    result.seconds = time.perf_counter() - start
    for c in conns:
        await c.close()
    return result


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
