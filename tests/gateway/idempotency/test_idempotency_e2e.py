"""`Idempotency-Key` through the real stack (Redis, sidecar, two workers, the gateway): a
retry answers what the first attempt answered and writes nothing; a stream's retry is the
same stream; another body is 409 `idempotency_key_reused`; a retry while the first attempt
runs is 409 `request_in_progress`; hostile header values are 400s that touch nothing."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.gateway.conftest import SDK, Stack


def new_key() -> str:
    return f"test-{uuid.uuid4()}"


def chat_session(http: httpx.Client) -> str:
    r = http.post(
        "/v1/context",
        json={"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}]},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def turn_body(sid: str, question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "session_id": sid,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
        **extra,
    }


def context(http: httpx.Client, sid: str) -> dict[str, Any]:
    r = http.get(f"/v1/context/{sid}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def sse(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body (`[DONE]` as the string)."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def replays(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("ctxcache_gateway_idempotent_replays_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_retried_chat_turn_answers_the_first_answer_and_appends_once(stack: Stack) -> None:
    with stack.client() as http:
        sid = chat_session(http)
        before = context(http, sid)
        key = new_key()
        replayed_before = replays(http)
        body = turn_body(sid, "What is a cache?")
        first = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key})
        assert first.status_code == 200, first.text
        after = context(http, sid)
        assert after["turns"] == before["turns"] + 1
        for _ in range(2):
            again = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key})
            assert again.status_code == 200, again.text
            assert again.json() == first.json()  # same id, text, usage, session
            assert again.headers["idempotent-replayed"] == "true"  # (charged no tokens)
        assert "idempotent-replayed" not in first.headers
        assert context(http, sid)["turns"] == after["turns"]
        assert context(http, sid)["context_tokens"] == after["context_tokens"]
        assert replays(http) == replayed_before + 2
        # the same text under another key is a new turn
        other = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": new_key()})
        assert other.status_code == 200 and other.json()["id"] != first.json()["id"]
        assert context(http, sid)["turns"] == after["turns"] + 1


def test_a_retried_stream_is_the_same_stream_and_appends_once(stack: Stack) -> None:
    with stack.client() as http:
        sid = chat_session(http)
        key = new_key()
        body = turn_body(sid, "Stream it.", stream=True, stream_options={"include_usage": True})
        first = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key})
        assert first.status_code == 200, first.text
        turns = context(http, sid)["turns"]
        again = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key})
        assert again.status_code == 200
        assert again.headers["content-type"].startswith("text/event-stream")
        assert again.headers["idempotent-replayed"] == "true"
        a, b = sse(first.text), sse(again.text)
        assert a[-1] == b[-1] == "[DONE]"

        def text(events: list[Any]) -> str:
            return "".join(
                (c["delta"].get("content") or "") for e in events[:-1] for c in e["choices"]
            )

        assert text(a) == text(b) and text(a)
        assert {e["id"] for e in a[:-1]} == {e["id"] for e in b[:-1]}  # one id, the same
        assert a[-2]["usage"] == b[-2]["usage"] and a[-2]["session"] == b[-2]["session"]
        assert context(http, sid)["turns"] == turns


def test_the_sdk_retry_with_a_key_gets_the_same_completion(stack: Stack, sdk: SDK) -> None:
    """The openai SDK sends the header given in `extra_headers` on each of its retries."""
    client = sdk()
    with stack.client() as http:
        sid = chat_session(http)
    key = new_key()

    def ask() -> Any:
        return client.completions.create(
            model="tiny",
            prompt=" and then",
            max_tokens=6,
            temperature=0,
            extra_body={"session_id": sid},
            extra_headers={"Idempotency-Key": key},
        )

    with pytest.raises(openai.BadRequestError):  # a chat session continues on chat only
        ask()
    with stack.client() as http:
        r = http.post("/v1/context", json={"model": "tiny", "prompt": "Once upon a time"})
        sid = r.json()["session_id"]
    first, second = ask(), ask()
    assert first.id == second.id and first.choices[0].text == second.choices[0].text
    with stack.client() as http:
        assert context(http, sid)["turns"] == 2


def test_the_same_key_with_another_body_is_409_and_writes_nothing(stack: Stack) -> None:
    with stack.client() as http:
        sid = chat_session(http)
        key = new_key()
        ok = http.post(
            "/v1/chat/completions", json=turn_body(sid, "One?"), headers={"Idempotency-Key": key}
        )
        assert ok.status_code == 200
        turns = context(http, sid)["turns"]
        r = http.post(
            "/v1/chat/completions", json=turn_body(sid, "Two?"), headers={"Idempotency-Key": key}
        )
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "idempotency_key_reused"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert context(http, sid)["turns"] == turns
        # on another route too
        other = http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "x", "session_id": sid},
            headers={"Idempotency-Key": key},
        )
        assert other.status_code == 409
        assert other.json()["error"]["code"] == "idempotency_key_reused"


def test_a_retry_while_the_first_attempt_runs_is_request_in_progress(stack: Stack) -> None:
    """Two attempts with one key at once: one runs, the other is 409 request_in_progress
    (not session_busy: the client learns its request is the one running)."""
    with stack.client() as http:
        sid = chat_session(http)
        key = new_key()
        # a few seconds: the second attempt and a third key come 0.3 s in
        body = turn_body(sid, "Tell a long story.", max_tokens=1000, ignore_eos=True)
        answers: list[httpx.Response] = []

        def run() -> None:
            with stack.client() as h:
                r = h.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key})
                answers.append(r)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 30
        while not answers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert answers, "no attempt answered"
        early = answers[0]
        assert early.status_code == 409, early.text
        assert early.json()["error"]["code"] == "request_in_progress"
        assert int(early.headers["retry-after-ms"]) > 0
        # another key meanwhile: the session is busy, as for any second turn
        busy = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": new_key()})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "session_busy"
        for t in threads:
            t.join(120)
        ran = answers[1]
        assert ran.status_code == 200, ran.text
        after = http.post("/v1/chat/completions", json=body, headers={"Idempotency-Key": key})
        assert after.status_code == 200 and after.json() == ran.json()


HOSTILE: list[tuple[str, bytes | str]] = [
    ("empty", b""),
    ("too long", "k" * 256),
    ("control character", b"abc\x01def"),
    ("tab", b"abc\tdef"),
    ("non-ASCII", "clé-é".encode("latin-1")),
    ("UTF-8 bytes", "ключ".encode()),
    ("DEL", b"abc\x7f"),
]


# control characters in a header value are refused by the server's HTTP parser (httptools)
# with its own 400 before any route runs; `check_header` refuses them too (unit test)
PARSER_REJECTS = {"control character", "DEL"}


@pytest.mark.parametrize(("what", "value"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_keys_are_rejected_clearly_and_write_nothing(
    stack: Stack, what: str, value: bytes | str
) -> None:
    with stack.client() as http:
        sid = chat_session(http)
        turns = context(http, sid)["turns"]
        listed = len(http.get("/v1/context", params={"limit": 100}).json()["data"])
        requests = [
            ("/v1/chat/completions", turn_body(sid, "Hi")),
            ("/v1/context", {"model": "tiny", "prompt": "hello"}),
            ("/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": 2}),
            ("/v1/conversations", {}),
        ]
        for path, body in requests:
            r = http.post(path, json=body, headers=[(b"Idempotency-Key", value)])
            assert r.status_code == 400, (what, path, r.text)
            if what in PARSER_REJECTS:  # the HTTP parser refuses the request: never reaches us
                assert r.text == "Invalid HTTP request received."
                continue
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and "Idempotency-Key" in err["message"]
            assert err["param"] == "idempotency-key"
        assert context(http, sid)["turns"] == turns
        assert len(http.get("/v1/context", params={"limit": 100}).json()["data"]) == listed


def test_two_key_headers_are_rejected(stack: Stack) -> None:
    with stack.client() as http:
        sid = chat_session(http)
        r = http.post(
            "/v1/chat/completions",
            json=turn_body(sid, "Hi"),
            headers=[(b"Idempotency-Key", b"a"), (b"Idempotency-Key", b"b")],
        )
        assert r.status_code == 400 and "one Idempotency-Key" in r.json()["error"]["message"]


def test_a_retried_context_create_returns_the_same_session(stack: Stack) -> None:
    with stack.client() as http:
        key = new_key()
        body = {"model": "tiny", "prompt": "The document.", "max_tokens": 4, "temperature": 0}
        first = http.post("/v1/context", json=body, headers={"Idempotency-Key": key})
        assert first.status_code == 200, first.text
        again = http.post("/v1/context", json=body, headers={"Idempotency-Key": key})
        assert again.status_code == 200 and again.json() == first.json()
        sid = first.json()["session_id"]
        assert context(http, sid)["turns"] == 1
        other = http.post(
            "/v1/context", json={**body, "prompt": "Another."}, headers={"Idempotency-Key": key}
        )
        assert other.status_code == 409
        assert other.json()["error"]["code"] == "idempotency_key_reused"
        # keys are per tenant: tenant-b's same key makes tenant-b's own session
    with stack.client("key-b") as http_b:
        theirs = http_b.post("/v1/context", json=body, headers={"Idempotency-Key": key})
        assert theirs.status_code == 200 and theirs.json()["session_id"] != sid
    with stack.client() as http:  # and a's session is still a's only
        assert http.get(f"/v1/context/{theirs.json()['session_id']}").status_code == 404


def test_a_retried_context_create_after_deleting_it_is_409_not_a_new_session(
    stack: Stack,
) -> None:
    """The key's record goes with the session but for a marker: a retry does not quietly
    make it again."""
    with stack.client() as http:
        key = new_key()
        body = {"model": "tiny", "prompt": "Gone soon."}
        first = http.post("/v1/context", json=body, headers={"Idempotency-Key": key})
        sid = first.json()["session_id"]
        assert http.delete(f"/v1/context/{sid}").status_code == 200
        again = http.post("/v1/context", json=body, headers={"Idempotency-Key": key})
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "idempotency_key_reused"
        assert "deleted" in again.json()["error"]["message"]
        assert http.get(f"/v1/context/{sid}").status_code == 404  # and nothing made again


def test_responses_and_conversations_retries(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    key = new_key()

    def create(**kw: Any) -> Any:
        return client.responses.create(
            model="tiny",
            max_output_tokens=4,
            temperature=0,
            extra_headers={"Idempotency-Key": kw.pop("key")},
            **kw,
        )

    first = create(input="Hello there.", key=key)
    again = create(input="Hello there.", key=key)
    assert again.id == first.id and again.output_text == first.output_text
    # continuing the chain: an append to its session, once
    k2 = new_key()
    nxt = create(input="And then?", previous_response_id=first.id, key=k2)
    nxt_again = create(input="And then?", previous_response_id=first.id, key=k2)
    assert nxt_again.id == nxt.id
    items = client.responses.input_items.list(nxt.id)
    assert [i.content[0].text for i in items.data] == ["And then?"]  # type: ignore[union-attr]
    # a fork (continuing from a response that is no longer the latest), once
    k3 = new_key()
    fork = create(input="Instead?", previous_response_id=first.id, key=k3)
    assert fork.id != nxt.id
    assert create(input="Instead?", previous_response_id=first.id, key=k3).id == fork.id
    # streamed: the retry is the same stream
    k4 = new_key()
    events = list(
        client.responses.create(
            model="tiny",
            input="Stream.",
            max_output_tokens=4,
            stream=True,
            extra_headers={"Idempotency-Key": k4},
        )
    )
    replay = list(
        client.responses.create(
            model="tiny",
            input="Stream.",
            max_output_tokens=4,
            stream=True,
            extra_headers={"Idempotency-Key": k4},
        )
    )
    assert replay[0].type == "response.created"
    assert events[-1].response.id == replay[-1].response.id  # type: ignore[union-attr]
    assert events[-1].response.output_text == replay[-1].response.output_text  # type: ignore[union-attr]
    # conversations
    k5 = new_key()
    conv = client.conversations.create(metadata={"a": "b"}, extra_headers={"Idempotency-Key": k5})
    conv_again = client.conversations.create(
        metadata={"a": "b"}, extra_headers={"Idempotency-Key": k5}
    )
    assert conv_again.id == conv.id and conv_again.created_at == conv.created_at
    k6 = new_key()
    turn = create(input="Hi conv.", conversation=conv.id, key=k6)
    assert create(input="Hi conv.", conversation=conv.id, key=k6).id == turn.id
    listed = client.conversations.items.list(conv.id)
    assert [i.role for i in listed.data] == ["assistant", "user"]  # type: ignore[union-attr]
