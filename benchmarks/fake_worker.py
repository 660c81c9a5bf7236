"""A fast fake of the worker/vLLM HTTP contract, for gateway benchmarks and load tests.

It answers instantly with deterministic output: tokens are the prompt's bytes, the
"model" repeats a fixed reply for `max_tokens` tokens (3 by default, at most 256); a stream
sends one chunk per token, then the usage chunk and `[DONE]`, as vLLM does. Chat requests
get chat-shaped answers. It is a test double at the network boundary (the gateway is always
also tested against the real worker); run it with `python -m benchmarks.fake_worker --port P`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

MODEL = "fake"
MAX_LEN = 1 << 20
REPLY = [ord(c) for c in " ok"]
MAX_REPLY_TOKENS = 256


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def _ids(body: dict[str, Any]) -> list[int]:
    if "messages" in body:
        text = "".join(f"<{m.get('role')}>{m.get('content') or ''}" for m in body["messages"])
        return list(text.encode()) + (
            list(b"<assistant>") if body.get("add_generation_prompt", True) else []
        )
    prompt = body.get("prompt", "")
    return list(prompt) if isinstance(prompt, list) else list(str(prompt).encode())


async def tokenize(request: Request) -> Response:
    ids = _ids(orjson.loads(await request.body()))
    return _json({"tokens": ids, "count": len(ids), "max_model_len": MAX_LEN})


def _reply(body: dict[str, Any]) -> list[int]:
    asked = body.get("max_tokens")
    n = min(3 if asked is None else int(asked), MAX_REPLY_TOKENS)  # 0: prefill only
    return [REPLY[i % len(REPLY)] for i in range(n)]


def _choice(chat: bool, ids: list[int], finish: str | None, *, delta: bool) -> dict[str, Any]:
    text = bytes(ids).decode()
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if chat:
        choice["delta" if delta else "message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
        choice["token_ids"] = ids
    return choice


async def completions(request: Request) -> Response:
    body = orjson.loads(await request.body())
    chat = request.url.path.endswith("/chat/completions")
    prompt = _ids(body)
    reply = _reply(body)
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(reply),
        "total_tokens": len(prompt) + len(reply),
        "prompt_tokens_details": {"cached_tokens": max(0, len(prompt) - 16)},
    }
    kind = "chat.completion" if chat else "text_completion"
    head = {
        "id": "chatcmpl-fake" if chat else "cmpl-fake",
        "object": kind + ".chunk" if chat and body.get("stream") else kind,
        "created": int(time.time()),
        "model": body.get("model", MODEL),
    }
    if not body.get("stream"):
        choice = _choice(chat, reply, "length", delta=False)
        return _json({**head, "choices": [choice], "usage": usage})

    async def events() -> Any:
        for i, token in enumerate(reply):
            finish = "length" if i == len(reply) - 1 else None
            choice = _choice(chat, [token], finish, delta=True)
            yield b"data: " + orjson.dumps({**head, "choices": [choice]}) + b"\n\n"
        yield b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def models(request: Request) -> Response:
    return _json(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": MAX_LEN}]}
    )


async def health(request: Request) -> Response:
    return _json({"status": "ok"})


def create_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
        ]
    )


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvicorn.run(
        create_app(),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
