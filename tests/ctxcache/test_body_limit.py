"""`ctxcache.body_limit`: a body framed by its Content-Length passes untouched, because the
server reads no more than that; a chunked body is counted. Driven through uvicorn's own
protocol (as every ctxcache service serves), so the framing relied on is uvicorn's."""

from __future__ import annotations

import orjson
from starlette.types import Receive, Scope, Send

from ctxcache.body_limit import BodyLimitMiddleware
from ctxcache.errors import CtxError, error_response
from tests.ctxcache.test_http_protocol import protocol, turns

LIMIT = 16
READ: list[bytes] = []  # each body the app read in full


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with the body it read (or the envelope of the error reading raised)."""
    if scope["type"] != "http":
        return
    body = b""
    try:
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
    except CtxError as exc:
        await error_response(exc)(scope, receive, send)
        return
    READ.append(body)
    head = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    await send({"type": "http.response.body", "body": body})


def answers(sent: list[bytes]) -> list[tuple[int, bytes]]:
    """(status, body) of each answer in what the server sent."""
    out = []
    for chunk in b"".join(sent).split(b"HTTP/1.1 ")[1:]:
        status = int(chunk[:3])
        out.append((status, chunk.partition(b"\r\n\r\n")[2]))
    return out


async def test_a_declared_length_is_all_the_app_reads_whatever_follows() -> None:
    http, raw = protocol(BodyLimitMiddleware(echo, max_bytes=LIMIT))
    READ.clear()
    extra = b"x" * (4 * LIMIT)  # past the limit, after the declared body: not this body
    http.data_received(b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 8\r\n\r\n12345678" + extra)
    await turns()
    assert READ in ([], [b"12345678"])  # never more than the declared 8 bytes
    assert answers(raw.sends)[-1][0] == 400 and raw.closed  # the rest: a malformed request
    http.connection_lost(None)


async def test_a_declared_length_over_the_limit_is_refused_unread() -> None:
    http, raw = protocol(BodyLimitMiddleware(echo, max_bytes=LIMIT))
    http.data_received(b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 17\r\n\r\n")
    await turns()
    [(status, body)] = answers(raw.sends)
    assert status == 413 and orjson.loads(body)["error"]["code"] == "request_too_large"
    http.connection_lost(None)


async def test_a_chunked_body_is_counted_as_it_arrives() -> None:
    http, raw = protocol(BodyLimitMiddleware(echo, max_bytes=LIMIT))
    head = b"POST /a HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    http.data_received(head + b"8\r\n12345678\r\n")
    http.data_received(b"8\r\nabcdefgh\r\n0\r\n\r\n")  # 16 bytes: at the limit
    await turns()
    assert answers(raw.sends) == [(200, b"12345678abcdefgh")]
    http.data_received(head + b"10\r\n" + b"y" * 16 + b"\r\n1\r\nz\r\n0\r\n\r\n")  # 17
    await turns()
    status, body = answers(raw.sends)[1]
    assert status == 413 and orjson.loads(body)["error"]["code"] == "request_too_large"
    http.connection_lost(None)
