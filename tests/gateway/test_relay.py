"""A stream without a session: the worker's bytes relayed as they are, and a client that
leaves mid-stream closes the worker's stream (so the worker stops generating for nobody)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from ctxcache.http_server import RAW_BODY
from gateway.completions.streams import SSERelay
from gateway.http1 import Http1Pool
from gateway.pool import Worker, WorkerPool
from gateway.settings import WorkerEndpoint
from gateway.upstream import open_stream
from tests.gateway.asgiclient import Client
from tests.gateway.rawhttp import CHUNKED_HEAD as HEAD
from tests.gateway.rawhttp import Handler, chunk, read_request, server

EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": []}\n\n']


@asynccontextmanager
async def worker_at(handler: Handler) -> AsyncIterator[tuple[WorkerPool, Worker]]:
    async with server(handler) as port:
        endpoint = WorkerEndpoint(id="w0", url=f"http://127.0.0.1:{port}")
        pool = WorkerPool(
            [endpoint],
            connect_timeout_s=1,
            request_timeout_s=5,
            health_interval_s=1,
            imbalance_slack=4,
            max_inflight=8,
        )
        worker = pool.workers[0]
        worker.fast = Http1Pool("127.0.0.1", port, connect_timeout_s=1, request_timeout_s=5)
        try:
            yield pool, worker
        finally:
            await worker.fast.aclose()


async def test_the_workers_bytes_go_through_as_they_are() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(HEAD + b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n")
            await writer.drain()

    client = Client()  # as uvicorn: "disconnect" once the answer is complete
    sent = client.sent

    async with worker_at(handler) as (pool, worker):
        upstream = await open_stream(worker, "/v1/completions", b"{}")
        await SSERelay(pool, worker, upstream)({"type": "http"}, client.receive, client.send)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
        assert b"".join(m.get("body", b"") for m in sent[1:]) == b"".join(EVENTS)
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        assert worker.inflight == 0 and len(worker.fast._idle) == 1  # kept for the next call


async def test_a_client_leaving_mid_stream_closes_the_workers_stream() -> None:
    worker_saw_close = asyncio.Event()

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(HEAD)
        try:
            while True:
                writer.write(chunk(EVENTS[0]))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            worker_saw_close.set()
            raise

    client = Client(leave_after=3)  # the head and two chunks: then the client goes
    sent = client.sent

    async with worker_at(endless) as (pool, worker):
        upstream = await open_stream(worker, "/v1/completions", b"{}")
        relay = SSERelay(pool, worker, upstream)
        # ends quietly
        await asyncio.wait_for(relay({"type": "http"}, client.receive, client.send), 5)
        await asyncio.wait_for(worker_saw_close.wait(), 5)
        assert worker.inflight == 0 and not worker.fast._idle
        assert all(m.get("more_body", True) for m in sent)  # no end: nobody to answer


class Recorder:
    """The client's connection as `ctxcache.http_server` lends it to a relay."""

    def __init__(self, buffered: int = 0) -> None:
        self.written: list[bytes] = []
        self.buffered = buffered  # what the connection says it has not sent yet

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def get_write_buffer_size(self) -> int:
        return self.buffered


@pytest.mark.parametrize("client_is_slow", [False, True])
async def test_a_chunked_stream_goes_on_in_the_workers_own_framing(client_is_slow: bool) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(HEAD + chunk(EVENTS[0]))
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(chunk(EVENTS[1]) + b"0\r\n\r\n")
            await writer.drain()

    connection = Recorder(buffered=1 << 20 if client_is_slow else 0)
    scope = {"type": "http", "extensions": {RAW_BODY: {"transport": connection}}}
    client = Client()
    sent = client.sent

    async with worker_at(handler) as (pool, worker):
        upstream = await open_stream(worker, "/v1/completions", b"{}")
        await SSERelay(pool, worker, upstream)(scope, client.receive, client.send)
        assert (b"transfer-encoding", b"chunked") in sent[0]["headers"]
        # the worker's framing, all but its last chunk (the server writes its own)
        assert b"".join(connection.written) == chunk(EVENTS[0]) + chunk(EVENTS[1])
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        # a slow client: after each part, an empty one, so the server waits for the client
        waits = [m for m in sent[1:-1] if m == {**m, "body": b"", "more_body": True}]
        assert len(waits) == (len(connection.written) if client_is_slow else 0)
        assert worker.inflight == 0 and len(worker.fast._idle) == 1
