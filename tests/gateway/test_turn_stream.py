"""A streamed session turn gives its turn back however its client leaves: before the first
byte (`never_started`), or mid-stream (the event generator's own `finally`).

(The end-to-end case — a client leaving mid-stream — runs against real processes in
test_errors_e2e.py; the moment before the first byte is too short to hit from outside.)
"""

from __future__ import annotations

import asyncio
import contextlib
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
