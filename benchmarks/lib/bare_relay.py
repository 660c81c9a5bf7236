"""The floor under the gateway's streaming TTFT: a bare ASGI app that relays a request to
one worker with the gateway's own worker client, served by the gateway's own server
configuration (`ctxcache.settings.server_config`: uvicorn, uvloop, `CoalescingHttp`) — no
FastAPI, no middleware, no routing, no auth, no error envelope. `ctxcache bench gateway
--floor` measures it beside the gateway: the difference is what the app's layers cost.

Run: `python -m benchmarks.lib.bare_relay --port P --worker http://127.0.0.1:W`.
"""

from __future__ import annotations

import argparse

from starlette.types import Receive, Scope, Send

from gateway.completions.router import read_body
from gateway.worker_client import WorkerClient

START = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
}
END = {"type": "http.response.body", "body": b"", "more_body": False}


class BareRelay:
    """POST PATH -> the worker's POST PATH; its status and body (streamed as it arrives)
    come back, under a text/event-stream head. GET: 200, for readiness checks."""

    def __init__(self, worker_url: str) -> None:
        self.worker_url = worker_url
        self.client: WorkerClient | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] == "GET":  # (GET /health: the supervisor's readiness check)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        if self.client is None:  # (made on the server's event loop)
            self.client = WorkerClient(self.worker_url, connect_timeout_s=5, request_timeout_s=60)
        body = await read_body(receive)
        answer = await self.client.request("POST", scope["path"], body)
        try:
            await send({**START, "status": answer.status})
            async for chunk in answer.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send(END)
        finally:
            answer.close()


def main() -> None:
    import uvicorn

    from ctxcache.settings import server_config

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker", required=True, help="http://HOST:PORT of the backend")
    args = p.parse_args()
    uvicorn.Server(server_config(BareRelay(args.worker), host="127.0.0.1", port=args.port)).run()


if __name__ == "__main__":
    main()
