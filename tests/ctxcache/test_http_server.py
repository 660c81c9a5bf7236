"""`ctxcache.http_server`: writes sent together, and the raw body writes a relay makes,
on a recording transport and on a real uvicorn server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from starlette.types import Receive, Scope, Send

from ctxcache.http_server import CoalescingHttpToolsProtocol, CoalescingTransport, raw_transport
from ctxcache.net import free_port
from gateway.http1 import Http1Pool
from tests.gateway.rawhttp import chunk


class Recording:
    """A transport that records each call that would send."""

    def __init__(self) -> None:
        self.sends: list[list[bytes]] = []
        self.closed = False

    def writelines(self, data: list[bytes]) -> None:
        self.sends.append(list(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0


async def test_a_turns_writes_go_out_together() -> None:
    sent = Recording()
    t = CoalescingTransport(sent, asyncio.get_running_loop())  # type: ignore[arg-type]
    t.write(b"head")
    assert sent.sends == []  # held: a body may follow in this turn
    t.write(b"body")
    assert sent.sends == [[b"head", b"body"]]  # the first two together, at once
    for event in (b"e1", b"", b"e2", b"e3"):
        t.write(event)
    assert t.get_write_buffer_size() == 6 and len(sent.sends) == 1  # the rest: held
    await asyncio.sleep(0)  # the turn ends: what is held goes, in one call
    assert sent.sends[1:] == [[b"e1", b"e2", b"e3"]]
    t.write(b"alone")
    await asyncio.sleep(0)
    assert sent.sends[2:] == [[b"alone"]]  # a write with nothing after it waits for no one
    t.write(b"last words")
    t.close()  # what was written before close goes out first
    assert sent.sends[3:] == [[b"last words"]] and sent.closed
    await asyncio.sleep(0)
    assert len(sent.sends) == 4  # nothing twice
    t.write(b"to nobody")  # the client is gone: dropped, as asyncio's transports do
    await asyncio.sleep(0)
    assert len(sent.sends) == 4


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """`/plain`: a JSON answer; `/relay`: a chunked body written in its own framing."""
    if scope["type"] != "http":
        return
    await receive()
    if scope["path"] == "/plain":
        body = b'{"ok": true}'
        headers = [(b"content-type", b"application/json"), (b"content-length", b"12")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return
    transport = raw_transport(scope)
    assert transport is not None
    headers = [(b"transfer-encoding", b"chunked")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    transport.write(chunk(b"data: 1\n\n"))
    await asyncio.sleep(0.01)
    transport.write(chunk(b"data: 2\n\n") + chunk(b"data: [DONE]\n\n"))
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@asynccontextmanager
async def serving() -> AsyncIterator[int]:
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=CoalescingHttpToolsProtocol,
        lifespan="off",
        log_config=None,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task


async def test_a_real_server_answers_plain_and_relayed_bodies_on_one_connection() -> None:
    async with serving() as port:
        client = Http1Pool("127.0.0.1", port, connect_timeout_s=1, request_timeout_s=5)
        for _ in range(2):
            assert await client.post("/plain", b"{}") == (200, b'{"ok": true}')
            status, body = await client.post("/relay", b"{}")
            assert (status, body) == (200, b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n")
        assert len(client._idle) == 1  # keep-alive held through both kinds of answer
        await client.aclose()


def test_an_app_served_otherwise_has_no_raw_transport() -> None:
    assert raw_transport({"type": "http"}) is None
    assert raw_transport({"type": "http", "extensions": {"http.response.trailers": {}}}) is None
