"""`gateway.http1` against real sockets: keep-alive, chunked bodies, every way a call fails."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gateway.http1 import ChunkScanner, ConnectionLost, Dechunker, Http1Pool
from tests.gateway.rawhttp import CHUNKED_HEAD, chunk, read_request, server


def pool(port: int, timeout: float = 5.0) -> Http1Pool:
    return Http1Pool("127.0.0.1", port, connect_timeout_s=1.0, request_timeout_s=timeout)


async def test_keep_alive_reuses_one_connection_and_reads_chunked_bodies() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while body := await read_request(reader):
            if body == b'"chunked"':
                writer.write(CHUNKED_HEAD)
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


BODY = chunk(b"abc") + b"2;ext=1\r\nde\r\n" + chunk(b"x" * 300) + b"0\r\nTrailer: t\r\n\r\n"
PAYLOAD = b"abcde" + b"x" * 300


@pytest.mark.parametrize("step", [1, 2, 7, 64, len(BODY)])
def test_dechunker_gives_the_payload_however_the_bytes_arrive(step: int) -> None:
    for offset in range(min(step, 8)):  # pieces of `step` bytes, after a first of `offset`
        d = Dechunker()
        cuts = [0, offset, *range(offset + step, len(BODY), step), len(BODY)]
        out = b"".join(d.feed(BODY[a:b]) for a, b in itertools.pairwise(cuts))
        assert out == PAYLOAD and d.done and d.clean


def test_dechunker_rejects_bad_framing_and_notices_bytes_after_the_end() -> None:
    d = Dechunker()
    assert d.feed(BODY + b"HTTP/1.1") == PAYLOAD and d.done and not d.clean
    with pytest.raises(ValueError):
        Dechunker().feed(b"zz\r\nabc\r\n")
    with pytest.raises(ValueError):
        Dechunker().feed(b"3\r\nabcd\r\n")  # longer than its size


FRAMED = BODY[: BODY.index(b"0\r\nTrailer")]  # what a relay passes on: all but the last chunk


def test_chunk_scanner_passes_on_all_but_the_last_chunk_however_the_bytes_arrive() -> None:
    for a, b in itertools.combinations(range(1, len(BODY)), 2):  # every cut in three pieces
        scan = ChunkScanner()
        out = [scan.feed(BODY[:a]), scan.feed(BODY[a:b])]
        assert not scan.done
        out.append(scan.feed(BODY[b:]))
        assert b"".join(out) == FRAMED and scan.done and scan.clean, (a, b)
        assert Dechunker().feed(b"".join(out) + b"0\r\n\r\n") == PAYLOAD


def test_chunk_scanner_rejects_bad_framing_and_notices_bytes_after_the_end() -> None:
    scan = ChunkScanner()
    assert scan.feed(BODY + b"HTTP/1.1") == FRAMED and scan.done and not scan.clean
    with pytest.raises(ValueError):
        ChunkScanner().feed(b"zz\r\nabc\r\n")
    with pytest.raises(ValueError):
        ChunkScanner().feed(b"3\r\nabcd\r\n0\r\n\r\n")  # longer than its size


async def test_a_framed_stream_keeps_its_framing_and_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(CHUNKED_HEAD + BODY[:5])
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(BODY[5:])
            await writer.drain()

    async with server(handler) as port:
        p = pool(port)
        for _ in range(2):
            answer = await p.stream("/s", b"{}")
            assert answer.chunked
            assert b"".join([part async for part in answer.framed()]) == FRAMED
        assert len(p._idle) == 1  # one connection, back in the pool after each stream
        await p.aclose()


async def test_a_stream_arrives_chunk_by_chunk_then_its_connection_is_reused() -> None:
    connections = 0
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while await read_request(reader):
            writer.write(CHUNKED_HEAD)
            writer.write(chunk(b"data: 1\n\n"))
            await writer.drain()
            await go_on.wait()  # the rest only once the client has the first chunk
            writer.write(chunk(b"data: 2\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
            go_on.clear()

    async with server(handler) as port:
        p = pool(port)
        answer = await p.stream("/s", b"{}")
        assert answer.status == 200
        got = []
        async for piece in answer.chunks():
            got.append(piece)
            go_on.set()
        # what one read brought comes out in one piece
        assert got == [b"data: 1\n\n", b"data: 2\n\ndata: [DONE]\n\n"]
        answer = await p.stream("/s", b"{}")
        go_on.set()
        assert await answer.read() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert connections == 1
        await p.aclose()


async def test_a_stream_closed_early_drops_its_connection() -> None:
    connections = 0
    server_saw_close = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        try:
            while True:
                writer.write(chunk(b"data: token\n\n"))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            server_saw_close.set()
            raise

    async with server(endless) as port:
        p = pool(port)
        answer = await p.stream("/s", b"{}")
        async for _ in answer.chunks():
            break
        answer.close()
        await asyncio.wait_for(server_saw_close.wait(), 5)
        answer = await p.stream("/s", b"{}")  # not the closed connection: a new one
        answer.close()
        assert connections == 2
        await p.aclose()


async def test_a_stream_that_stalls_or_breaks_off() -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"a"))
        await writer.drain()
        await asyncio.sleep(10)

    async with server(stalls) as port:
        p = pool(port, timeout=0.3)
        answer = await p.stream("/s", b"{}")
        with pytest.raises(TimeoutError):  # the whole stream is bounded, not only its head
            await answer.read()
        await p.aclose()

    async def breaks_off(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD + chunk(b"a"))
        await writer.drain()
        writer.close()

    async with server(breaks_off) as port:
        p = pool(port)
        answer = await p.stream("/s", b"{}")
        with pytest.raises(ConnectionLost):
            await answer.read()
        await p.aclose()
