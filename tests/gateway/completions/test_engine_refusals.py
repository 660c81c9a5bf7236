"""An engine's refusal comes back in our envelope (`invalid_request_error`, a string `code`,
the engine's message, `param` and 4xx status), with or without a session, streamed or not
(docs/architecture.md, "Errors the engine answers"). A scripted worker answers each request
with the body its `x_status` / `x_error` fields choose, as vLLM 0.32 writes them
(`vllm.entrypoints.serve.engine.protocol.ErrorResponse`: `type` the HTTP phrase, `code`
the status as a number)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from ctxcache.errors import BackendUnavailable, ContextLengthExceeded, SessionBusy
from ctxcache.redis_server import RedisServer
from gateway.upstream import EngineRefusal, refused_payload, worker_error
from tests.gateway.conftest import Stack
from tests.gateway.scripted import Gateways, ScriptedWorker, answer

TOO_LONG = (
    "This model's maximum context length is 4096 tokens. However, your prompt contains 5000 "
    "input tokens, which exceeds this limit even without any output tokens. Please reduce "
    "the length of the input prompt."
)


def vllm_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    phrase = {400: "BadRequestError", 404: "NotFoundError", 422: "UnprocessableEntityError"}
    error = {"message": message, "type": phrase.get(status, "Error"), "param": param}
    return {"error": {**error, "code": status}}


async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
    status = int(body.get("x_status", 400))
    doc = body.get("x_error") or vllm_error(status, "no", body.get("x_param"))
    w.write(answer(status, orjson.dumps(doc) if not isinstance(doc, str) else doc.encode()))


@pytest.fixture(scope="module")
def url(redis_server: RedisServer) -> Iterator[str]:
    worker = ScriptedWorker(reply).start()
    gateways = Gateways()
    yield gateways.start(
        redis_url=redis_server.url,
        workers=[f"http://127.0.0.1:{worker.port}"],
        health_interval_s=0.2,
    )
    gateways.close()


def post(url: str, path: str = "/v1/chat/completions", **body: object) -> httpx.Response:
    doc: dict[str, Any] = {"model": "m", "max_tokens": 4, **body}
    if path.endswith("chat/completions"):
        doc.setdefault("messages", [{"role": "user", "content": "hi"}])
    else:
        doc.setdefault("prompt", "hi")
    return httpx.post(f"{url}{path}", json=doc, timeout=10)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize(
    ("status", "param", "code"),
    [
        (400, "response_format", "invalid_request"),
        (422, "messages", "invalid_request"),
        (404, None, "not_found"),
    ],
)
def test_a_refusal_without_a_session_is_in_our_envelope(
    url: str, path: str, stream: bool, status: int, param: str | None, code: str
) -> None:
    r = post(url, path, stream=stream, x_status=status, x_param=param)
    assert r.status_code == status
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {
        "error": {"message": "no", "type": "invalid_request_error", "param": param, "code": code}
    }


def test_a_prompt_over_the_window_is_context_length_exceeded(url: str) -> None:
    r = post(url, x_error=vllm_error(400, TOO_LONG, "input_tokens"))
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": TOO_LONG,
        "type": "invalid_request_error",
        "param": "input_tokens",
        "code": "context_length_exceeded",
    }


def test_the_openai_sdk_reads_a_string_code(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with client, pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"x_param": "tool_choice"},
        )
    assert err.value.code == "invalid_request" and err.value.param == "tool_choice"
    assert err.value.type == "invalid_request_error"


def test_ours_a_5xx_and_a_body_without_an_envelope_pass_as_they_are(url: str) -> None:
    ours = ContextLengthExceeded("too long", param="messages").envelope()
    r = post(url, x_status=400, x_error=ours)
    assert r.status_code == 400 and r.json() == ours
    r = post(url, x_status=500, x_error=vllm_error(500, "engine crashed"))
    assert r.status_code == 500 and r.json() == vllm_error(500, "engine crashed")
    r = post(url, x_status=401, x_error={"error": "Unauthorized"})  # (vLLM's --api-key)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}


def test_a_session_turns_engine_refusal_keeps_the_engines_status() -> None:
    """`worker_error`, which a session turn's engine call and every stream read: a 4xx in
    vLLM's envelope is the client's error with the engine's status (before: 422 became 400,
    other 4xx a 503); ours and a 5xx are as before."""
    for status, code in [(400, "invalid_request"), (422, "invalid_request"), (404, "not_found")]:
        err = worker_error(status, orjson.dumps(vllm_error(status, "no", "n")))
        assert isinstance(err, EngineRefusal)
        assert (err.status, err.code, err.param, err.message) == (status, code, "n", "no")
        assert err.envelope()["error"]["type"] == "invalid_request_error"
    too_long = worker_error(400, orjson.dumps(vllm_error(400, TOO_LONG, "input_tokens")))
    assert isinstance(too_long, ContextLengthExceeded)
    busy = worker_error(409, orjson.dumps(SessionBusy().envelope()))
    assert isinstance(busy, SessionBusy)
    assert isinstance(worker_error(500, orjson.dumps(vllm_error(500, "x"))), BackendUnavailable)
    assert isinstance(worker_error(404, b'{"detail": "Not Found"}'), BackendUnavailable)


def test_a_refusal_in_our_envelope_keeps_its_bytes() -> None:
    raw = orjson.dumps(ContextLengthExceeded("x", param="prompt").envelope())
    assert refused_payload(400, raw) is raw
    code = {"error": {"message": "m", "type": "BadRequestError", "param": None, "code": "bad"}}
    assert orjson.loads(refused_payload(400, orjson.dumps(code)))["error"]["code"] == "bad"


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_built_in_workers_window_without_a_session(
    stack: Stack, stream: bool
) -> None:
    """End to end through the built-in worker (its envelope is ours, and stays so)."""
    with stack.client() as http:
        r = http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "cache " * 5000, "max_tokens": 4, "stream": stream},
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded"
