"""`gateway.worker_client` against real sockets: keep-alive, chunked bodies, every way a
call fails, and the framing it refuses to trust."""

from __future__ import annotations

import asyncio

import pytest

from gateway.worker_client import HIGH_WATER, Answer, ConnectionLost, Misframed, WorkerClient
from tests.gateway.rawhttp import CHUNKED_HEAD, chunk, read_request, server


def pool(port: int, timeout: float = 5.0) -> WorkerClient:
    return WorkerClient(
        f"http://127.0.0.1:{port}", connect_timeout_s=1.0, request_timeout_s=timeout
    )


async def stream(client: WorkerClient, path: str) -> Answer:
    return await client.request("POST", path, b"{}")


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
async def test_a_chunked_body_arrives_whole_however_its_bytes_are_split(step: int) -> None:
    async def dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            whole = CHUNKED_HEAD + BODY
            for i in range(0, len(whole), step):
                writer.write(whole[i : i + step])
                await writer.drain()
                await asyncio.sleep(0)

    async with server(dribble) as port:
        p = pool(port)
        for _ in range(2):
            assert await p.post("/s", b"{}") == (200, PAYLOAD)
        assert len(p._idle) == 1  # one connection, back in the pool after each answer
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
        answer = await stream(p, "/s")
        assert answer.status == 200
        got = []
        async for piece in answer.chunks():
            got.append(piece)
            go_on.set()
        # what one read brought comes out in one piece
        assert got == [b"data: 1\n\n", b"data: 2\n\ndata: [DONE]\n\n"]
        answer = await stream(p, "/s")
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
        answer = await stream(p, "/s")
        async for _ in answer.chunks():
            break
        answer.close()
        await asyncio.wait_for(server_saw_close.wait(), 5)
        answer = await stream(p, "/s")  # not the closed connection: a new one
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
        answer = await stream(p, "/s")
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
        answer = await stream(p, "/s")
        with pytest.raises(ConnectionLost):
            await answer.read()
        await p.aclose()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 2\r\n\r\n",
    ],
)
async def test_an_answer_with_ambiguous_framing_fails_and_its_connection_is_never_reused(
    head: bytes,
) -> None:
    """Two lengths, or a length and chunks: which bytes are this answer's is a guess, so
    the call fails and the connection is closed; the next call gets a connection of its
    own and its own answer, never the tail of this one."""
    connections = 0
    first = True

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections, first
        connections += 1
        while await read_request(reader):
            if first:  # a mis-framed answer, with bytes that could pass for another's
                writer.write(head + b'{}{"tail": "of the first"}')
                first = False
            else:
                writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n"right"')
            await writer.drain()

    async with server(handler) as port:
        p = pool(port)
        with pytest.raises(Misframed):
            await p.post("/", b"{}")
        assert not p._idle
        assert await p.post("/", b"{}") == (200, b'"right"')
        assert connections == 2
        await p.aclose()


@pytest.mark.parametrize("later", [False, True])
async def test_bytes_after_the_end_of_an_answer_close_its_connection(later: bool) -> None:
    """A worker that sends more than the answer (in the same read as its last chunk, or
    later, while the connection is idle): the answer is whole, the extra bytes reach
    nobody, and the connection is not reused."""
    connections = 0
    extra = b'HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n"evil"'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while await read_request(reader):
            answer = CHUNKED_HEAD + chunk(b"data: 1\n\n") + b"0\r\n\r\n"
            if later:
                writer.write(answer)
                await writer.drain()
                await asyncio.sleep(0.05)
                writer.write(extra)
            else:
                writer.write(answer + extra)  # one write: one read on the client's side
            await writer.drain()

    async with server(handler) as port:
        p = pool(port)
        for _ in range(2):
            answer = await stream(p, "/s")
            assert await answer.read() == b"data: 1\n\n"
            await asyncio.sleep(0.1)
            assert not p._idle  # closed, not pooled
        assert connections == 2
        await p.aclose()


async def test_a_pause_at_the_moment_an_answer_ends_does_not_stick_to_its_connection() -> None:
    """A reader that has not taken a big body yet pauses reading from the worker; when the
    read that crosses the high-water mark also ends the answer, the connection goes back
    to the pool reading again, and the next call on it is answered at once (not after
    the request timeout)."""
    connections = 0
    big = b"x" * (HIGH_WATER + 1000)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while await read_request(reader):
            writer.write(CHUNKED_HEAD + chunk(big) + b"0\r\n\r\n")  # one read: pause and end
            await writer.drain()

    async with server(handler) as port:
        p = pool(port, timeout=60)
        answer = await stream(p, "/s")
        await asyncio.sleep(0.2)  # the whole answer arrives while nobody reads it
        assert answer.done and len(p._idle) == 1
        assert p._idle[0].transport.is_reading()
        assert await answer.read() == big
        answer = await asyncio.wait_for(stream(p, "/s"), 2)
        assert await asyncio.wait_for(answer.read(), 2) == big
        assert connections == 1
        await p.aclose()


async def test_a_slow_reader_pauses_the_worker_and_reading_resumes_it() -> None:
    written = 0
    piece = chunk(b"y" * 65_536)

    async def firehose(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal written
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        while written < 1 << 30:
            writer.write(piece)
            await writer.drain()  # blocks while the client does not read
            written += len(piece)

    async with server(firehose) as port:
        p = pool(port, timeout=60)
        answer = await stream(p, "/s")
        await asyncio.sleep(0.5)
        stalled_at = written
        await asyncio.sleep(0.3)
        assert written == stalled_at < 64 << 20  # paused, after the buffers filled
        async for _ in answer.chunks():
            if written > stalled_at + (8 << 20):
                break
        assert written > stalled_at
        answer.close()
        await p.aclose()


async def test_a_path_prefix_and_extra_headers_reach_the_worker() -> None:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with server(handler) as port:
        p = WorkerClient(
            f"http://127.0.0.1:{port}/engine/", connect_timeout_s=1, request_timeout_s=5
        )
        assert await p.get("/health") == (200, b"ok")
        await p.aclose()
    assert seen[0].startswith(b"GET /engine/health HTTP/1.1\r\n")
    assert b"Content-Length" not in seen[0]
