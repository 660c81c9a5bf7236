"""A scripted worker whose every byte a test chooses, and gateways served by uvicorn as
`ctxcache gateway` serves them (create_app, `server_config`), each in a thread: for tests
that need the real HTTP server between a client and a worker they control."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import orjson
import uvicorn

from ctxcache.net import free_port
from ctxcache.settings import server_config
from gateway.app import create_app
from gateway.settings import GatewaySettings

# answers one completion request (its parsed body) on the worker's connection
Reply = Callable[[asyncio.StreamReader, asyncio.StreamWriter, dict], Awaitable[None]]


@dataclass
class ScriptedWorker:
    """A worker on a thread of its own: health, models (model `m`), and `reply` for each
    completion request; it records each request's body."""

    reply: Reply
    port: int = field(default_factory=free_port)
    requests: list[dict] = field(default_factory=list)
    streams_on: set[int] = field(default_factory=set)  # connections that served a request
    closed: threading.Event = field(default_factory=threading.Event)  # a client hung up

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1]
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = orjson.loads(await r.readexactly(length)) if length else {}
                if path == b"/health":
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                elif path == b"/v1/models":
                    models = orjson.dumps({"data": [{"id": "m", "max_model_len": 4096}]})
                    w.write(answer(200, models))
                else:
                    self.requests.append(body)
                    self.streams_on.add(id(w))
                    await self.reply(r, w, body)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()
        finally:
            w.close()

    def start(self) -> ScriptedWorker:
        ready = threading.Event()

        async def main() -> None:
            server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
            ready.set()
            async with server:
                await server.serve_forever()

        threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
        assert ready.wait(5)
        return self


def answer(status: int, payload: bytes) -> bytes:
    """A JSON answer, whole."""
    head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    return head % (status, len(payload)) + payload


class Gateways:
    """Gateways on uvicorn, configured as `ctxcache gateway` runs them, each in a thread;
    `close` stops them all."""

    def __init__(self) -> None:
        self._running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(self, headers: dict[str, str] | None = None, **settings: object) -> str:
        """A gateway with these settings; its base URL once it is up and lists a worker
        (`headers`: what its `/v1/models` needs)."""
        port = free_port()
        app = create_app(GatewaySettings(port=port, **settings))  # type: ignore[arg-type]
        server = uvicorn.Server(server_config(app, host="127.0.0.1", port=port))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self._running.append((server, thread))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        last: object = None
        while True:  # up, and its workers listed
            try:
                last = httpx.get(f"{url}/v1/models", headers=headers)
                if last.json()["data"]:
                    return url
            except httpx.HTTPError as e:
                last = e
            assert time.monotonic() < deadline, f"the gateway did not come up {last!r}"
            time.sleep(0.05)

    def close(self) -> None:
        for server, thread in self._running:
            server.should_exit = True
            thread.join(10)
