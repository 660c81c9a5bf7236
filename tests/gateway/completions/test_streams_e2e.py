"""Streams without a session (`gateway.completions.streams.relayed`) on a real server: the
gateway app served by uvicorn as `ctxcache gateway` serves it, in front of scripted workers
whose every byte the test chooses."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import orjson
import pytest

from tests.gateway.rawhttp import chunk
from tests.gateway.scripted import Gateways, Reply, ScriptedWorker, answer
from tests.utils import relayed_streams

KEY = "relay-key"
AUTH = {"authorization": f"Bearer {KEY}"}
EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": []}\n\n']
EVENTS.append(b"data: [DONE]\n\n")
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


async def stream_reply(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
    """The events, each in a write of its own (as uvicorn sends a worker's stream)."""
    w.write(HEAD)
    for event in EVENTS:
        await asyncio.sleep(0)
        w.write(chunk(event))
    w.write(b"0\r\n\r\n")


@dataclass
class Worker(ScriptedWorker):
    """A scripted worker that streams `EVENTS` unless told otherwise."""

    reply: Reply = stream_reply


@pytest.fixture
def serve(redis_url: str) -> Iterator[Callable[..., str]]:
    """`serve(worker, ...)`: the gateway in front of those workers, on uvicorn configured
    as `ctxcache gateway` runs it; its base URL."""
    gateways = Gateways()

    def start(*workers: Worker, **settings: object) -> str:
        return gateways.start(
            AUTH,
            redis_url=redis_url,
            workers=[f"http://127.0.0.1:{w.port}" for w in workers],
            api_keys={KEY: "tenant"},
            health_interval_s=0.2,
            **settings,
        )

    yield start
    gateways.close()


def stream(url: str, client: httpx.Client | None = None, **extra: object) -> httpx.Response:
    body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True, **extra}
    if client is None:
        return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=10)
    return client.post(f"{url}/v1/completions", json=body, headers=AUTH)


def test_a_stream_is_relayed_as_the_worker_sent_it(serve: Callable[..., str]) -> None:
    worker = Worker().start()
    url = serve(worker)
    with httpx.Client(timeout=10) as client:  # one connection to the gateway, kept alive
        for _ in range(3):
            r = stream(url, client)
            assert r.status_code == 200
            assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
            assert r.headers["transfer-encoding"] == "chunked"
            assert r.content == b"".join(EVENTS)
    assert len(worker.streams_on) == 1  # the worker's connection was kept alive and reused
    assert relayed(url) == 3
    # the tenant's cache_salt was added, as on every worker request without a session
    assert all(isinstance(req.get("cache_salt"), str) for req in worker.requests)
    assert len(worker.requests) == 3


# the worker's chunks, one with an extension, the last with a trailer: valid HTTP the
# client need not see
CHUNKS = chunk(EVENTS[0]) + b"5;note=x\r\nhello\r\n" + chunk(EVENTS[1]) + b"0\r\nx-t: 1\r\n\r\n"


@pytest.mark.parametrize("piece", [1, 7, 4096])
def test_a_workers_chunks_arrive_whole_however_they_are_read(
    serve: Callable[..., str], piece: int
) -> None:
    """Whatever reads the worker's bytes come in, the client gets the same payload, and the
    worker's connection serves the next stream."""

    async def dribble(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        whole = HEAD + CHUNKS
        for i in range(0, len(whole), piece):
            w.write(whole[i : i + piece])
            await w.drain()
            await asyncio.sleep(0.001)

    worker = Worker(dribble).start()
    url = serve(worker)
    with httpx.Client(timeout=10) as client:
        for _ in range(2):
            r = stream(url, client)
            assert r.status_code == 200 and r.content == EVENTS[0] + b"hello" + EVENTS[1]
    assert len(worker.streams_on) == 1
    assert relayed(url) == 2


def test_a_stream_the_worker_sent_with_a_length_is_sent_in_chunks(
    serve: Callable[..., str],
) -> None:
    async def sized(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        events = b"".join(EVENTS)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(events))
        w.write(events[:10])
        await w.drain()
        await asyncio.sleep(0.01)
        w.write(events[10:])

    url = serve(Worker(sized).start())
    for _ in range(2):
        r = stream(url)
        assert r.status_code == 200 and r.content == b"".join(EVENTS)
        assert r.headers["transfer-encoding"] == "chunked"
    assert relayed(url) == 2


def relayed(url: str) -> float:
    return relayed_streams(httpx, url)


@contextmanager
def streaming(url: str) -> Iterator[httpx.Response]:
    """A stream request whose answer is read as the test goes."""
    body = {"model": "m", "prompt": "hi", "stream": True}
    with (
        httpx.Client(timeout=20) as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r,
    ):
        yield r


def test_pipelined_streams_come_back_whole_and_in_order(serve: Callable[..., str]) -> None:
    async def numbered(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        w.write(HEAD + chunk(b"data: %s\n\n" % body["prompt"].encode()) + b"0\r\n\r\n")

    url = serve(Worker(numbered).start())
    port = int(url.rsplit(":", 1)[1])
    requests = b""
    for i in range(3):
        payload = orjson.dumps({"model": "m", "prompt": f"n{i}", "stream": True})
        requests += (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer %b\r\ncontent-length: %d\r\n\r\n%b"
            % (KEY.encode(), len(payload), payload)
        )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(requests)  # all three at once, before any answer
        got = b""
        while got.count(b"0\r\n\r\n") < 3:
            data = sock.recv(65536)
            assert data, got
            got += data
    assert got.count(b"HTTP/1.1 200 OK") == 3
    assert got.index(b"data: n0") < got.index(b"data: n1") < got.index(b"data: n2")
    assert relayed(url) == 3


def test_a_worker_error_is_our_envelope(serve: Callable[..., str]) -> None:
    async def too_long(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        error = {
            "error": {
                "message": "too long",
                "type": "invalid_request_error",
                "param": None,
                "code": "context_length_exceeded",
            }
        }
        payload = orjson.dumps(error)
        w.write(answer(400, payload))

    url = serve(Worker(too_long).start())
    for _ in range(2):  # and the connection serves the next one
        r = stream(url)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert relayed(url) == 0  # an error answer, no stream


def test_a_worker_that_hangs_up_before_answering_fails_over(serve: Callable[..., str]) -> None:
    async def hang_up(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        raise ConnectionResetError  # (the worker closes the connection)

    dead, alive = Worker(hang_up).start(), Worker().start()
    url = serve(dead, alive)
    for _ in range(4):  # whichever the relay picks, the answer is the live worker's stream
        r = stream(url)
        assert r.status_code == 200 and r.content == b"".join(EVENTS)
    assert relayed(url) == 4


def test_a_worker_that_never_answers_is_a_backend_timeout(serve: Callable[..., str]) -> None:
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        await r.read()  # until the gateway gives up and closes

    worker = Worker(silent).start()
    url = serve(worker, request_timeout_s=0.5)
    r = stream(url)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "backend_timeout"
    assert worker.closed.wait(5)
    assert relayed(url) == 0


def test_a_stream_that_ends_with_the_workers_connection_is_whole(
    serve: Callable[..., str],
) -> None:
    async def unframed(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
        w.write(b"".join(EVENTS))
        await w.drain()
        raise ConnectionResetError  # (no length, no chunks: the body ends when this closes)

    url = serve(Worker(unframed).start())
    for _ in range(2):
        r = stream(url)
        assert r.status_code == 200 and r.content == b"".join(EVENTS)
    assert relayed(url) == 2


def test_a_stream_the_worker_cuts_is_cut_for_the_client(serve: Callable[..., str]) -> None:
    async def cut(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        w.write(HEAD + chunk(EVENTS[0]))
        await w.drain()
        raise ConnectionResetError

    url = serve(Worker(cut).start())
    with pytest.raises(httpx.RemoteProtocolError):  # never a complete-looking answer
        stream(url)
    assert relayed(url) == 1


def test_a_client_that_leaves_closes_the_workers_stream(serve: Callable[..., str]) -> None:
    async def endless(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        w.write(HEAD)
        while True:
            w.write(chunk(EVENTS[0]))
            await w.drain()
            await asyncio.sleep(0.02)

    worker = Worker(endless).start()
    url = serve(worker)
    with streaming(url) as r:
        assert r.status_code == 200
        next(r.iter_bytes())
    assert worker.closed.wait(5)  # the gateway hung up on the worker
    assert relayed(url) == 1


@pytest.mark.parametrize(
    "case",
    ["bad key", "expect 100-continue", "body over 64 KiB", "bad cache_salt", "unknown model"],
)
def test_edge_requests_get_the_answer_they_should(serve: Callable[..., str], case: str) -> None:
    url = serve(Worker().start())
    body: dict[str, object] = {"model": "m", "prompt": "hi", "stream": True}
    headers = dict(AUTH)
    if case == "bad key":
        headers["authorization"] = "Bearer nope"
    elif case == "expect 100-continue":
        headers["expect"] = "100-continue"
    elif case == "body over 64 KiB":
        body["prompt"] = "x" * 100_000
    elif case == "bad cache_salt":
        body["cache_salt"] = 7
    else:
        body["model"] = "nope"
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=10)
    expected = {
        "bad key": (401, None),
        "expect 100-continue": (200, b"".join(EVENTS)),
        "body over 64 KiB": (200, b"".join(EVENTS)),
        "bad cache_salt": (400, None),
        "unknown model": (404, None),
    }[case]
    assert r.status_code == expected[0], r.text
    assert relayed(url) == (1 if expected[0] == 200 else 0)
    if expected[1] is not None:
        assert r.content == expected[1]
    else:
        assert "error" in r.json()


def test_the_head_goes_out_before_a_slow_first_event(serve: Callable[..., str]) -> None:
    """A long prefill does not hold the head back (the worker here sends its first event
    only once the client has the head)."""
    client_has_head = threading.Event()

    async def slow(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        w.write(HEAD)
        await w.drain()
        await asyncio.to_thread(client_has_head.wait)
        w.write(b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n")

    def give_up() -> None:  # (without the head, the test fails after 10 s, not hangs)
        if not client_has_head.wait(10):
            client_has_head.set()

    threading.Thread(target=give_up, daemon=True).start()
    url = serve(Worker(slow).start())
    with streaming(url) as r:
        assert not client_has_head.is_set()  # the head came before any event
        client_has_head.set()
        assert r.status_code == 200
        assert r.read() == b"".join(EVENTS)
    assert relayed(url) == 1


def test_a_slow_client_pauses_reading_from_the_worker(serve: Callable[..., str]) -> None:
    """The gateway reads the worker no faster than the client takes the stream: what it
    holds for a client that stopped reading stays bounded (the sockets' buffers and the
    worker client's high-water mark)."""
    piece = chunk(b"data: " + b"x" * 65_536 + b"\n\n")
    written = [0]

    async def firehose(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        w.write(HEAD)
        while written[0] < 1 << 30:
            w.write(piece)
            await w.drain()  # blocks while the gateway does not read
            written[0] += len(piece)
        w.write(b"0\r\n\r\n")

    worker = Worker(firehose).start()
    url = serve(worker)
    with streaming(url) as r:
        pieces = r.iter_raw()
        next(pieces)
        time.sleep(1.0)  # the client stops reading; the worker could write ~1 GB meanwhile
        stalled_at = written[0]
        time.sleep(0.5)
        assert written[0] == stalled_at < 64 << 20  # stopped, after the buffers filled
        for _ in pieces:  # reading again resumes the worker
            if written[0] > stalled_at + (8 << 20):
                break
        assert written[0] > stalled_at
    assert worker.closed.wait(5)


def test_bytes_after_a_streams_last_chunk_reach_nobody(serve: Callable[..., str]) -> None:
    """A worker that writes more after its last chunk, in the same read: the client's
    stream ends where the worker's answer ended, at once, without those bytes; the worker
    connection is not used again."""

    async def chatty(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        extra = b'HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\n"evil"'
        w.write(HEAD + b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n" + extra)

    worker = Worker(chatty).start()
    url = serve(worker, request_timeout_s=30)
    for _ in range(2):
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "m", "prompt": "hi", "stream": True},
            headers=AUTH,
            timeout=5,  # (a stream that hung until the request timeout fails here)
        )
        assert r.status_code == 200 and r.content == b"".join(EVENTS)
    assert len(worker.streams_on) == 2  # a connection each


def test_a_misframed_worker_answer_is_a_worker_error_and_poisons_nothing(
    serve: Callable[..., str],
) -> None:
    """A plain answer with two lengths: a worker error (503, our envelope), and the next
    request gets its own answer on a new connection, not the tail of that one."""
    sent: list[int] = []

    async def misframed(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
        payload = orjson.dumps({"n": len(sent)})
        sent.append(1)
        if len(sent) == 1:
            w.write(
                b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\ncontent-length: 2\r\n\r\n" % len(payload)
                + payload
            )
        else:
            w.write(answer(200, payload))

    worker = Worker(misframed).start()
    url = serve(worker)
    body = {"model": "m", "prompt": "hi"}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable"
    r = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=5)
    assert r.status_code == 200 and r.json() == {"n": 1}
