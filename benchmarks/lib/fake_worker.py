"""A fast fake of the worker/vLLM HTTP contract, for gateway benchmarks and load tests.

It answers instantly with deterministic output: tokens are the prompt's bytes, the
"model" repeats a fixed reply for `max_tokens` tokens (3 by default, at most 256); a stream
sends one chunk per token, then the usage chunk and `[DONE]`, as vLLM does. Chat requests
get chat-shaped answers. It is a test double at the network boundary (the gateway is always
also tested against the real worker); run it with `python -m benchmarks.lib.fake_worker --port P`.

With `--sidecar lm://HOST:PORT` it also uses a real KV sidecar the way our worker does, with
made-up KV: a request tagged with a session (`kv_transfer_params["lmcache.tag.s"]`) looks up
its prompt's full chunks (chained chunk hashes, `--chunk-size` tokens) with GET until the
first miss, stores the chunks it missed (`--kv-bytes-per-token` bytes a token, a `KV_2LTD`
payload), and answers `cached_tokens` = the tokens of the chunks it found. So the sidecar's
memory, pins and hit rate are real while no model runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import threading
import time
from array import array
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
TAG = "lmcache.tag.s"


class FakeKV:
    """Made-up KV in a real sidecar: one blocking lm:// connection per thread."""

    def __init__(self, url: str, chunk: int, bytes_per_token: int) -> None:
        self.url = url
        self.chunk = chunk
        self.payload = bytes(chunk * bytes_per_token)
        self.shape = (2, 1, chunk, max(1, bytes_per_token // 4))  # bfloat16: 2 bytes a value
        self._local = threading.local()

    def _client(self) -> Any:
        from sidecar.client import KVClient

        kv = getattr(self._local, "kv", None)
        if kv is None:
            kv = self._local.kv = KVClient.from_url(self.url, timeout=10.0)
        return kv

    def keys(self, ids: list[int], tag: str) -> list[str]:
        out, h = [], b""
        for start in range(0, len(ids) - self.chunk + 1, self.chunk):
            chunk = array("I", ids[start : start + self.chunk]).tobytes()
            h = hashlib.blake2b(h + chunk, digest_size=8).digest()
            out.append(f"fake@1@0@{h.hex()}@bfloat16@s%{tag}")
        return out

    def reuse(self, ids: list[int], tag: str) -> int:
        """Tokens found in the sidecar (a prefix of whole chunks); stores the rest."""
        from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD

        kv, keys = self._client(), self.keys(ids, tag)
        hits = 0
        for key in keys:
            if kv.get(key) is None:
                break
            hits += 1
        for key in keys[hits:]:
            kv.put(key, self.payload, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=self.shape)
        return hits * self.chunk


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
    cached = max(0, len(prompt) - 16)
    kv: FakeKV | None = request.app.state.kv
    tag = (body.get("kv_transfer_params") or {}).get(TAG)
    if kv is not None:
        cached = await asyncio.to_thread(kv.reuse, prompt, tag) if tag else 0
    usage = {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(reply),
        "total_tokens": len(prompt) + len(reply),
        "prompt_tokens_details": {"cached_tokens": cached},
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


def create_app(kv: FakeKV | None = None) -> Starlette:
    app = Starlette(
        routes=[
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
        ]
    )
    app.state.kv = kv
    return app


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--sidecar", default=None, help="lm://HOST:PORT: store made-up KV there")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens a sidecar block")
    p.add_argument("--kv-bytes-per-token", type=int, default=128, help="made-up KV size")
    args = p.parse_args()
    kv = FakeKV(args.sidecar, args.chunk_size, args.kv_bytes_per_token) if args.sidecar else None
    uvicorn.run(
        create_app(kv),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        loop="uvloop",
        http="httptools",
    )


if __name__ == "__main__":
    main()
