"""A session turn that resends the session's whole history (as LangGraph's and pydantic-ai's
agents do, given `session_id`) is the same turn as one that sends only what is new: the
history is not appended again (docs/agents.md, "A turn that resends the history")."""

from __future__ import annotations

from typing import Any

import httpx
import openai

from tests.gateway.conftest import SDK, Stack

FACTS = " ".join(f"Fact {i}: caches keep turns." for i in range(12))
SYSTEM = {"role": "system", "content": "You answer briefly. " + FACTS}
QUESTIONS = ["What do caches keep?", "Where?", "For how long?"]


def created(http: httpx.Client, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    r = http.post(
        "/v1/context",
        json={"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return r.json()


def create(http: httpx.Client, messages: list[dict[str, Any]], max_tokens: int) -> str:
    return str(created(http, messages, max_tokens)["session_id"])


def context_tokens(http: httpx.Client, sid: str) -> tuple[int, int]:
    info = http.get(f"/v1/context/{sid}").json()
    return info["context_tokens"], info["turns"]


def ask(client: openai.OpenAI, sid: str, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"session_id": sid},
    )


def test_resending_the_history_appends_only_the_new_turn(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    first = [SYSTEM, {"role": "user", "content": "Hello."}]
    with stack.client() as http:
        only_new, made = create(http, first, 8), created(http, first, 8)
    resends = str(made["session_id"])
    # the first answer, as the create gave it (the same for both sessions: greedy)
    history: list[dict[str, Any]] = [*first, made["choices"][0]["message"]]
    for step, question in enumerate(QUESTIONS, start=1):
        new = {"role": "user", "content": question}
        want = ask(client, only_new, [new])
        history.append(new)
        got = ask(client, resends, history)  # the whole conversation, every step
        assert got.choices[0].message.content == want.choices[0].message.content, step
        assert got.usage is not None and want.usage is not None
        assert got.usage.prompt_tokens == want.usage.prompt_tokens, step
        with stack.client() as http:
            assert context_tokens(http, resends) == context_tokens(http, only_new), step
        # the openai SDK's echo of the answer: `to_dict()` on odd steps, else
        # `model_dump(exclude_none=True)` (what agent loops over the SDK send back)
        message = got.choices[0].message
        echo = message.to_dict() if step % 2 else message.model_dump(exclude_none=True)
        history.append(echo)  # type: ignore[arg-type]


def test_resending_exactly_the_history_answers_it(stack: Stack, sdk: SDK) -> None:
    """A prefilled session sent its own messages again: nothing new, the answer to them
    (what the same messages get without a session), and only the answer is appended."""
    client = sdk()
    messages = [SYSTEM, {"role": "user", "content": "What do caches keep?"}]
    with stack.client() as http:
        sid = create(http, messages, 0)
        before, _ = context_tokens(http, sid)
    want = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
    )
    got = ask(client, sid, messages)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage is not None and want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    with stack.client() as http:
        after, turns = context_tokens(http, sid)
    assert before < want.usage.prompt_tokens  # (the prefill had no generation prompt)
    assert after == want.usage.prompt_tokens + got.usage.completion_tokens
    assert turns == 2


def test_a_turn_sharing_part_of_the_history_is_new_messages(stack: Stack, sdk: SDK) -> None:
    """Messages that do not begin with the whole history are all new, as before."""
    client = sdk()
    first = [SYSTEM, {"role": "user", "content": "Hello."}]
    with stack.client() as http:
        sid = create(http, first, 8)
        before, _ = context_tokens(http, sid)
    got = ask(client, sid, [SYSTEM, {"role": "user", "content": "Hello again."}])
    assert got.usage is not None
    with stack.client() as http:
        after, turns = context_tokens(http, sid)
    # the whole prompt is the old history and both messages again, as today
    assert after == got.usage.prompt_tokens + got.usage.completion_tokens
    assert got.usage.prompt_tokens > before + 20 and turns == 2
