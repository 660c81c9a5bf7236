"""`ctxcache.http_protocol`: uvicorn's own httptools protocol on a transport that sends the
writes of one event-loop turn together. Driven here with a transport that records each
send, so what leaves in one send is exact, not a matter of timing."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from ctxcache.http_protocol import CoalescingHttp, CoalescingTransport
from ctxcache.settings import server_config


class Recorder(asyncio.Transport):
    """A transport that records each send (`write` or `writelines` call) as one entry."""

    def __init__(self) -> None:
        super().__init__()
        self.sends: list[bytes] = []
        self.closed = self.aborted = self.reading_paused = False

    def write(self, data: Any) -> None:
        self.sends.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        self.sends.append(b"".join(list_of_data))

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading_paused = True

    def resume_reading(self) -> None:
        self.reading_paused = False


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_writes_of_one_turn_leave_in_one_send_in_order() -> None:
    raw = Recorder()
    t = CoalescingTransport(raw, asyncio.get_running_loop())
    t.write(b"head ")
    t.writelines([b"body", b"", b" more"])
    assert raw.sends == [] and t.get_write_buffer_size() == len(b"head body more")
    await turns(1)
    assert raw.sends == [b"head body more"]
    t.write(b"next")
    await turns(1)
    assert raw.sends == [b"head body more", b"next"]


async def test_close_sends_what_is_held_and_abort_drops_it() -> None:
    raw = Recorder()
    t = CoalescingTransport(raw, asyncio.get_running_loop())
    t.write(b"last words")
    t.close()
    assert raw.sends == [b"last words"] and raw.closed
    t.write(b"after close")  # dropped, as a closed asyncio transport drops it
    await turns()
    assert raw.sends == [b"last words"]

    raw = Recorder()
    t = CoalescingTransport(raw, asyncio.get_running_loop())
    t.write(b"never sent")
    t.abort()
    await turns()
    assert raw.sends == [] and raw.aborted


async def test_an_event_stream_s_head_leaves_with_its_first_event_at_once() -> None:
    """After an event stream's head, a write sends at once (the head with it, the first
    time); a plain answer's head and body still wait for the turn's end."""
    raw = Recorder()
    t = CoalescingTransport(raw, asyncio.get_running_loop())
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n\r\n"
    t.write(head)
    assert raw.sends == []  # the head waits for the first event
    t.write(b"5\r\nfirst\r\n")
    assert raw.sends == [head + b"5\r\nfirst\r\n"]  # before the turn ends
    t.write(b"4\r\nnext\r\n")
    t.write(b"0\r\n\r\n")
    assert raw.sends[1:] == [b"4\r\nnext\r\n", b"0\r\n\r\n"]

    plain = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n"
    t.write(plain)
    t.write(b"{}")
    assert len(raw.sends) == 3  # the next answer on the connection is plain: held
    await turns(1)
    assert raw.sends[3:] == [plain + b"{}"]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """A plain JSON answer, or (`/stream`; `/events`: an event stream) a head, two parts
    sent in one go, then one more after a wait, then the end."""
    if scope["type"] != "http":
        return
    await receive()
    if scope["path"] not in ("/stream", "/events"):
        head = [(b"content-type", b"application/json"), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"{}"})
        return
    sse = [(b"content-type", b"text/event-stream; charset=utf-8")]
    head = sse if scope["path"] == "/events" else []
    await send({"type": "http.response.start", "status": 200, "headers": head})
    for event in (b"one", b"two"):
        await send({"type": "http.response.body", "body": event, "more_body": True})
    await asyncio.sleep(0.01)
    await send({"type": "http.response.body", "body": b"three", "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def protocol(app: Any) -> tuple[CoalescingHttp, Recorder]:
    """The protocol uvicorn builds for each connection from `server_config`, on a
    recorder, with the arguments uvicorn's server passes to an `http=` class."""
    config = server_config(app, host="127.0.0.1", port=8000)
    config.load()
    assert config.http_protocol_class is CoalescingHttp
    made = config.http_protocol_class(  # type: ignore[call-arg]
        config=config, server_state=ServerState(), app_state={}, _loop=None
    )
    raw = Recorder()
    made.connection_made(raw)
    return made, raw


async def test_a_plain_answer_leaves_in_one_send_head_and_body() -> None:
    http, raw = protocol(app)
    request = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"
    http.data_received(request)
    await turns()
    assert len(raw.sends) == 1, raw.sends
    assert raw.sends[0].startswith(b"HTTP/1.1 200 OK\r\n") and raw.sends[0].endswith(b"\r\n{}")

    http.data_received(request)  # keep-alive: the next request on the same connection
    await turns()
    assert len(raw.sends) == 2 and raw.sends[1].endswith(b"\r\n{}")
    http.connection_lost(None)


async def test_a_stream_s_head_leaves_with_its_first_events_then_each_as_it_comes() -> None:
    http, raw = protocol(app)
    http.data_received(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
    await turns()
    assert len(raw.sends) == 1, raw.sends
    head, _, events = raw.sends[0].partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head and events == b"3\r\none\r\n3\r\ntwo\r\n"
    await asyncio.sleep(0.05)
    assert raw.sends[1:] == [b"5\r\nthree\r\n0\r\n\r\n"]
    http.connection_lost(None)


async def test_an_event_stream_through_uvicorn_sends_each_event_as_it_is_written() -> None:
    http, raw = protocol(app)
    http.data_received(b"GET /events HTTP/1.1\r\nhost: t\r\n\r\n")
    await turns()
    assert len(raw.sends) == 2, raw.sends  # the head with the first event, then the second
    head, _, first = raw.sends[0].partition(b"\r\n\r\n")
    assert b"content-type: text/event-stream" in head and first == b"3\r\none\r\n"
    assert raw.sends[1] == b"3\r\ntwo\r\n"
    await asyncio.sleep(0.05)
    assert raw.sends[2:] == [b"5\r\nthree\r\n", b"0\r\n\r\n"]
    http.data_received(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")  # then a plain answer
    await turns()
    assert len(raw.sends) == 5 and raw.sends[4].endswith(b"\r\n{}")
    http.connection_lost(None)


async def test_a_connection_close_request_is_answered_then_closed() -> None:
    http, raw = protocol(app)
    http.data_received(b"GET /x HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
    await turns()
    assert len(raw.sends) == 1 and raw.sends[0].endswith(b"{}") and raw.closed


def test_uvicorn_takes_a_protocol_class_as_its_http_option() -> None:
    """The public option this relies on: `Config(http=cls)` serves with `cls`, built with
    config, server_state, app_state and _loop (checked above by building it so)."""
    config = uvicorn.Config(app, http=CoalescingHttp)
    config.load()
    assert config.http_protocol_class is CoalescingHttp
