"""A new conversation's first request (`gateway.implicit.first`): what it adds to the
engine request, and what of the answer the client gets (nothing it did not ask for) and
the state keeps (the answer's message and the exact ids)."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.implicit.first import FirstRequest
from gateway.pool import Worker

WORKER = Worker("w0", "http://w0", None, client=None)  # type: ignore[arg-type]


def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def chunk(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {"id": "c", "object": "chat.completion.chunk", "choices": [{**choice, "token_ids": ids}]}


def made(wants_ids: bool = False) -> tuple[FirstRequest, list[FirstRequest]]:
    done: list[FirstRequest] = []
    return FirstRequest("ab" * 16, wants_ids, lambda f, w: done.append(f)), done


def test_the_engine_request_carries_the_tag_and_asks_for_the_ids() -> None:
    first, _ = made()
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    sent = orjson.loads(first.engine_raw(raw, orjson.loads(raw)))
    assert sent["kv_transfer_params"] == {"lmcache.tag.s": "ab" * 16}
    assert sent["return_token_ids"] is True and sent["messages"] == orjson.loads(raw)["messages"]


def test_a_whole_answer_loses_the_ids_and_keeps_its_message() -> None:
    first, done = made()
    answer = {
        "id": "x",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "token_ids": [7, 8]}
        ],
    }
    out = orjson.loads(first.answer(orjson.dumps(answer), WORKER))
    assert out["prompt_token_ids"] is None and out["choices"][0]["token_ids"] is None
    assert done == [first] and first.tokens() == [1, 2, 3, 7, 8]
    assert first.assistant() == {"role": "assistant", "content": "ok"}


def test_a_stream_loses_the_ids_and_the_chunks_sent_only_for_them() -> None:
    first, done = made()
    head = {**chunk({"role": "assistant", "content": ""}, []), "prompt_token_ids": [1, 2]}
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": "{"},
    }
    events = [
        event(head),
        event(chunk({"content": "Hel"}, [5])),
        event(chunk({}, [6])),  # (vLLM: a chunk only for its ids, the parser holding text)
        event(chunk({"tool_calls": [call]}, [9])),
        event(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}, [10])),
        event(chunk({}, [11], "tool_calls")),
        b"data: [DONE]\n\n",
    ]
    raw = b"".join(events)
    out = first.feed(raw[:37]) + first.feed(raw[37:]) + first.end(WORKER)  # (split mid-event)
    sent = [orjson.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert len(sent) == 5  # the chunk only for its ids is gone; the finish chunk stays
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c for c in sent)
    assert out.endswith(b"data: [DONE]\n\n") and done == [first]
    assert first.tokens() == [1, 2, 5, 6, 9, 10, 11]
    message = first.assistant()
    assert message["content"] == "Hel" and message["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": "{}",
    }


def test_a_client_that_asked_for_the_ids_gets_them() -> None:
    first, _ = made(wants_ids=True)
    one = event(chunk({}, [6]))
    assert first.feed(one) == one


def test_a_cut_stream_keeps_nothing() -> None:
    first, done = made()
    first.feed(event(chunk({"content": "Hel"}, [5])))
    first.end(WORKER)
    assert done == []  # (no finish: the answer is not whole)


def test_an_engine_without_ids_keeps_messages_only() -> None:
    first, done = made()
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]}
    first.answer(orjson.dumps(answer), WORKER)
    assert done == [first] and first.tokens() == []  # (the next turn renders the history)
