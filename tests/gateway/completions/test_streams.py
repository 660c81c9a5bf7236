"""`SSEResponse` (gateway/completions/streams.py), every streamed answer's ASGI response: a
streamed session turn gives its turn back however its client leaves: before the first
byte (`never_started`), or mid-stream (the event generator's own `finally`).

(The end-to-end case — a client leaving mid-stream — runs against real processes in
test_errors_e2e.py; the moment before the first byte is too short to hit from outside.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator

from starlette.types import Message

from gateway.completions.streams import SSEResponse
from tests.gateway.asgiclient import Client


async def test_a_client_gone_before_the_first_byte_releases_the_turn() -> None:
    released: list[str] = []

    async def events() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: {}\n\n"
        finally:
            released.append("by the stream")

    async def never_started() -> None:
        released.append("by the response")

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        raise OSError("the client is gone")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with contextlib.suppress(Exception):  # Starlette reports the disconnect; what matters: -
        await SSEResponse(events(), never_started)(scope, receive, send)
    assert released == ["by the response"]

    # a stream that ran releases through its own `finally`, and only there
    released.clear()
    sent: list[Message] = []

    async def record(message: Message) -> None:
        sent.append(message)

    await SSEResponse(events(), never_started)(scope, receive, record)
    assert released == ["by the stream"] and sent[0]["type"] == "http.response.start"


async def test_a_client_leaving_mid_stream_ends_the_stream_and_its_turn() -> None:
    released: list[str] = []

    async def endless() -> AsyncGenerator[bytes, None]:
        try:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0.01)
        finally:
            released.append("by the stream")

    async def never_started() -> None:
        released.append("by the response")

    client = Client(leave_after=3)  # the head and two events: then the client goes
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    stream = SSEResponse(endless(), never_started)
    await asyncio.wait_for(stream(scope, client.receive, client.send), 5)
    assert released == ["by the stream"]
    assert all(m.get("more_body", True) for m in client.sent)  # no end: nobody to answer


async def test_a_stream_that_fails_unexpectedly_ends_with_an_error_event() -> None:
    """Not only a worker that drops or a refused commit: any failure after the status was
    sent ends the stream with OpenAI's error envelope (the SDK raises it), never a silent
    cut, and the generator's own `finally` still runs."""
    released: list[str] = []

    async def failing() -> AsyncGenerator[bytes, None]:
        try:
            yield b'data: {"choices": []}\n\n'
            raise KeyError("a bug of ours")
        finally:
            released.append("by the stream")

    client = Client(leave_after=100)
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    await asyncio.wait_for(SSEResponse(failing())(scope, client.receive, client.send), 5)
    bodies = [m.get("body", b"") for m in client.sent if m["type"] == "http.response.body"]
    assert bodies[0] == b'data: {"choices": []}\n\n'
    last = json.loads(bodies[-1].removeprefix(b"data: "))
    assert last["error"]["code"] == "internal_error"
    assert "a bug of ours" not in bodies[-1].decode()  # details stay in the log
    assert released == ["by the stream"]
