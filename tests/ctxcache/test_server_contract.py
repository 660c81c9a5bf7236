"""What ctxcache relies on from its HTTP stack (uvicorn, Starlette, httptools), pinned
exactly in pyproject.toml: each test here fails if an upgrade changes that behaviour.

The gateway's worker client relies on httptools being strict about framing: that is
tests/gateway/test_worker_client.py (two lengths, a length with chunks: the call fails).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from importlib.metadata import version

import httpx
import pytest
import uvicorn
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ctxcache.net import free_port
from ctxcache.settings import server_config
from gateway.app import create_app
from gateway.settings import GatewaySettings

PINNED = {
    "fastapi": "0.136.3",
    "starlette": "1.10.0",
    "uvicorn": "0.54.0",
    "httptools": "0.9.0",
    "uvloop": "0.23.0",
}


def test_the_installed_http_stack_is_the_one_this_file_checked() -> None:
    assert {name: version(name) for name in PINNED} == PINNED


class Streams:
    """An ASGI app: `/forever` streams until the client leaves (and records that it was
    told); `/cut` starts a chunked answer and returns without ending it; anything else
    answers `ok`."""

    def __init__(self) -> None:
        self.told_disconnect = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] not in ("/forever", "/cut"):
            headers = [(b"content-length", b"2")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        if scope["path"] == "/cut":
            return
        while (await receive())["type"] != "http.disconnect":
            pass
        self.told_disconnect.set()


@pytest.fixture
def served() -> Iterator[tuple[Streams, int]]:
    app, port = Streams(), free_port()
    server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield app, port
    server.should_exit = True
    thread.join(10)


def test_a_client_that_leaves_mid_stream_is_told_to_the_app(served: tuple[Streams, int]) -> None:
    """The gateway's streams stop (and close the worker's) on `http.disconnect`."""
    app, port = served
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /forever HTTP/1.1\r\nhost: x\r\n\r\n")
        got = b""
        while b"first" not in got:
            data = sock.recv(4096)
            assert data, got
            got += data
    assert app.told_disconnect.wait(2)


def test_an_answer_the_app_does_not_end_is_cut_for_the_client(
    served: tuple[Streams, int],
) -> None:
    """A stream whose worker broke off ends without its last chunk, and the server closes
    the connection: the client sees a cut answer, never a complete-looking one."""
    _, port = served
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(f"http://127.0.0.1:{port}/cut", timeout=5)


def test_an_idle_connection_outlives_uvicorns_default_keep_alive(
    served: tuple[Streams, int],
) -> None:
    """A connection left idle longer than uvicorn's default 5 s still answers: a client or
    proxy that reuses it after its own idle time is not reset (`KEEP_ALIVE_S`)."""
    _, port = served
    request = b"GET /ok HTTP/1.1\r\nhost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for pause in (0.0, 5.5):
            time.sleep(pause)
            sock.sendall(request)
            got = b""
            while not got.endswith(b"ok"):
                data = sock.recv(4096)
                assert data, f"closed after {pause} s idle"
                got += data
            assert got.startswith(b"HTTP/1.1 200")


async def test_a_starlette_route_to_an_asgi_app_names_its_route(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion routes are ASGI apps in Starlette `Route`s: Starlette calls them as
    they are, and names the route in the scope (the metrics' `route` label)."""
    app = create_app(GatewaySettings(redis_url=redis_url, workers=["http://127.0.0.1:1"]))
    route = next(r for r in app.routes if getattr(r, "path", "") == "/v1/completions")
    assert isinstance(route, Route) and route.app is route.endpoint
    seen: dict[str, object] = {}

    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        seen["route"] = scope.get("route")
        seen["app"] = scope.get("app")
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    monkeypatch.setattr(route, "app", endpoint)  # (the route is the module's: put back after)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.post("/v1/completions", content=b"{}")
        assert r.status_code == 204
        r = await client.get("/v1/completions")
        assert r.status_code == 405  # the route's methods still apply
    assert seen == {"route": route, "app": app}
    await asyncio.sleep(0)
