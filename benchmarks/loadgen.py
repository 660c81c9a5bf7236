"""A minimal HTTP/1.1 keep-alive load generator (one connection per concurrent client).

General clients (httpx, aiohttp) cost more per request than the servers being measured;
this one writes pre-built request bytes and reads `Content-Length` responses, so on the
same 2-core machine the numbers reflect the server, not the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import orjson


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

    async def send(self, request: bytes) -> tuple[int, bytes]:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length == 0 and b"chunked" in head.lower():
            raise RuntimeError("chunked responses are not supported by this load generator")
        body = await self.reader.readexactly(length) if length else b""
        return status, body

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
) -> tuple[list[float], float, int]:
    """Send `requests` requests over `concurrency` connections; (latencies, seconds, errors)."""
    conns = [await Conn.open(host, port) for _ in range(concurrency)]
    latencies: list[float] = []
    errors = 0
    counter = iter(range(requests))

    async def client(conn: Conn) -> None:
        nonlocal errors
        for i in counter:
            req = make_request(conn, i)
            t0 = time.perf_counter()
            status, _ = await conn.send(req)
            latencies.append(time.perf_counter() - t0)
            if status >= 400:
                errors += 1
            if progress is not None:
                progress(1)

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in conns))
    elapsed = time.perf_counter() - start
    for c in conns:
        await c.close()
    return latencies, elapsed, errors
