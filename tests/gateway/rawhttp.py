"""A raw asyncio HTTP server for tests of the gateway's worker client: every byte chosen."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


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


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)
