"""`gateway.http1` against real sockets: keep-alive, chunked bodies, every way a call fails."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from gateway.http1 import ConnectionLost, Http1Pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        await asyncio.sleep(0.01)  # let closed transports finish before the loop ends


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


def pool(port: int, timeout: float = 5.0) -> Http1Pool:
    return Http1Pool("127.0.0.1", port, connect_timeout_s=1.0, request_timeout_s=timeout)


async def test_keep_alive_reuses_one_connection_and_reads_chunked_bodies() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while body := await read_request(reader):
            if body == b'"chunked"':
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                writer.write(b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
            else:
                writer.write(
                    b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                )
            await writer.drain()

    async with server(handler) as port:
        p = pool(port)
        assert await p.post("/a", b'{"x": 1}') == (201, b'{"x": 1}')
        assert await p.post("/a", b'"chunked"') == (200, b"abcde")
        assert await p.post("/a", b"[]") == (201, b"[]")
        assert connections == 1
        await p.aclose()


async def test_an_idle_connection_the_server_closed_is_replaced() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()  # keep-alive ended by the server, as uvicorn does after its timeout

    async with server(handler) as port:
        p = pool(port)
        assert await p.post("/", b"1") == (200, b"1")
        await asyncio.sleep(0.05)
        assert await p.post("/", b"2") == (200, b"2")
        await p.aclose()


async def test_failures_are_connection_lost_or_timeout() -> None:
    async def dies_mid_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async with server(dies_mid_answer) as port:
        p = pool(port)
        with pytest.raises(ConnectionLost):
            await p.post("/", b"{}")
        await p.aclose()

    async def never_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(10)

    async with server(never_answers) as port:
        p = pool(port, timeout=0.3)
        with pytest.raises(TimeoutError):
            await p.post("/", b"{}")
        await p.aclose()

    async with server(never_answers) as port:
        pass  # closed: nothing listens on the port any more
    with pytest.raises(ConnectionLost):
        await pool(port).post("/", b"{}")
