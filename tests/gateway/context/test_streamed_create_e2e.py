"""A create that streams its first answer (`POST /v1/context` with `stream: true`), through
the real stack (Redis, sidecar, two built-in workers, the gateway): the answer is the full
conversation's, the session exists once the stream is over, holds the answer, and goes on
like any other; a retry with the same `Idempotency-Key` is the same stream and writes
nothing; a stream the client leaves creates nothing; `max_tokens: 0` cannot stream."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.gateway.completions.test_cancellation_e2e import LONG, running, wait_running
from tests.gateway.conftest import Stack
from tests.gateway.context.test_sessions_e2e import DOC
from tests.gateway.idempotency.test_idempotency_e2e import context, new_key, sse

HISTORY = [
    {"role": "system", "content": "You answer from this document. " + DOC},
    {"role": "user", "content": "What does the cache keep?"},
]
ASK = {"model": "tiny", "max_tokens": 10, "temperature": 0}


def text_of(events: list[Any], chat: bool = True) -> str:
    """The answer a stream's events spell (the `[DONE]` at the end left out)."""
    pieces = []
    for event in events[:-1]:
        for choice in event["choices"]:
            pieces.append(choice["delta"].get("content") or "" if chat else choice["text"])
    return "".join(pieces)


def test_a_streamed_create_answers_as_the_full_history_and_the_session_goes_on(
    stack: Stack,
) -> None:
    body = {**ASK, "messages": HISTORY, "stream": True, "stream_options": {"include_usage": True}}
    with stack.client() as http:
        r = http.post("/v1/context", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/event-stream")
        sid = r.headers["x-session-id"]
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["session_id"] == sid
        assert usage["session"]["context_tokens"] == usage["usage"]["total_tokens"]
        assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
        first = text_of(events)
        full = http.post("/v1/chat/completions", json={**ASK, "messages": HISTORY}).json()
        assert first and first == full["choices"][0]["message"]["content"]
        assert usage["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]

        info = context(http, sid)  # written before the last events were sent
        assert info["turns"] == 1 and info["context_tokens"] == usage["usage"]["total_tokens"]
        # the next turn sees the streamed answer as the conversation's
        question = {"role": "user", "content": "Where is it kept?"}
        turn = http.post(
            "/v1/chat/completions", json={**ASK, "session_id": sid, "messages": [question]}
        )
        assert turn.status_code == 200, turn.text
        history = [*HISTORY, {"role": "assistant", "content": first}, question]
        want = http.post("/v1/chat/completions", json={**ASK, "messages": history}).json()
        got = turn.json()
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * got["usage"]["prompt_tokens"]


def test_a_streamed_prompt_create_is_a_text_completion_stream(stack: Stack) -> None:
    prompt = "Notes on caching." + DOC
    with stack.client() as http:
        r = http.post("/v1/context", json={**ASK, "prompt": prompt, "stream": True})
        assert r.status_code == 200, r.text
        events = sse(r.text)
        assert {e["object"] for e in events[:-1]} == {"text_completion"}
        full = http.post("/v1/completions", json={**ASK, "prompt": prompt}).json()
        assert text_of(events, chat=False) == full["choices"][0]["text"]
        assert context(http, r.headers["x-session-id"])["turns"] == 1


@pytest.mark.parametrize("extra", [{}, {"max_tokens": 0}])
def test_a_stream_needs_tokens_to_stream(stack: Stack, extra: dict[str, Any]) -> None:
    body = {"model": "tiny", "messages": HISTORY, "stream": True, **extra}
    with stack.client() as http:
        before = len(http.get("/v1/context", params={"limit": 100}).json()["data"])
        r = http.post("/v1/context", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_request"
        assert r.json()["error"]["param"] == "stream"
        assert len(http.get("/v1/context", params={"limit": 100}).json()["data"]) == before


def test_a_retried_streamed_create_is_the_same_stream_and_one_session(stack: Stack) -> None:
    body = {**ASK, "messages": HISTORY, "stream": True, "stream_options": {"include_usage": True}}
    with stack.client() as http:
        key = new_key()
        first = http.post("/v1/context", json=body, headers={"Idempotency-Key": key})
        assert first.status_code == 200, first.text
        again = http.post("/v1/context", json=body, headers={"Idempotency-Key": key})
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
        assert again.headers["content-type"].startswith("text/event-stream")
        a, b = sse(first.text), sse(again.text)
        assert a[-1] == b[-1] == "[DONE]" and text_of(a) == text_of(b)
        assert {e["id"] for e in a[:-1]} == {e["id"] for e in b[:-1]}  # one id, the same
        assert a[-2]["session"] == b[-2]["session"]
        sid = first.headers["x-session-id"]
        assert again.headers["x-session-id"] == sid
        assert a[-2]["session_id"] == sid and context(http, sid)["turns"] == 1
        # the same key, not streamed: another body, so another request
        plain = http.post(
            "/v1/context", json={**body, "stream": False}, headers={"Idempotency-Key": key}
        )
        assert plain.status_code == 409
        assert plain.json()["error"]["code"] == "idempotency_key_reused"


def test_a_streamed_create_the_client_leaves_creates_nothing(stack: Stack) -> None:
    key = new_key()
    body = {**LONG, "prompt": "Go on and on.", "stream": True}
    with stack.client() as http:
        assert wait_running(stack, 0) >= 0
        with http.stream("POST", "/v1/context", json=body, headers={"Idempotency-Key": key}) as r:
            assert r.status_code == 200
            sid = r.headers["x-session-id"]
            lines = r.iter_lines()
            next(lines)  # the first token is out: mid-stream
            assert running(stack) == 1
        assert wait_running(stack, 0) < 5  # the worker stopped generating for nobody
        assert http.get(f"/v1/context/{sid}").status_code == 404
        # and its key is free again: the same request is a first attempt once more
        deadline = time.monotonic() + 5
        while True:
            with http.stream(
                "POST", "/v1/context", json=body, headers={"Idempotency-Key": key}
            ) as again:
                status = again.status_code
                if status == 200:
                    next(again.iter_lines())
            if status != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200
        assert wait_running(stack, 0) < 5
