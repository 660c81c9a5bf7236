"""End to end through the official openai SDK: a session turn == the full conversation."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import SDK, Stack
from tests.utils import relayed_streams

DOC = " ".join(
    f"Section {i}: the cache keeps the history of every turn on the server." for i in range(40)
)
QUESTIONS = [
    "What does the cache keep?",
    "Where is it kept?",
    "For how long?",
    "And after that?",
    "Thanks, anything else?",
]


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {}).get(name)


def test_five_turn_chat_session_equals_full_history(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    system = {"role": "system", "content": "You answer from this document. " + DOC}
    history: list[dict[str, Any]] = [system, {"role": "user", "content": QUESTIONS[0]}]
    with stack.client() as http:
        r = http.post(
            "/v1/context",
            json={
                "model": "tiny",
                "messages": history,
                "max_tokens": 12,
                "temperature": 0,
                "ttl": 600,
            },
        )
    assert r.status_code == 200, r.text
    created = r.json()
    sid = created["session_id"]
    assert created["object"] == "chat.completion" and sid.startswith("ctx_")
    first = created["choices"][0]["message"]["content"]
    full = client.chat.completions.create(
        model="tiny", messages=history, max_tokens=12, temperature=0
    )
    assert full.choices[0].message.content == first
    history.append({"role": "assistant", "content": first})

    for turn, question in enumerate(QUESTIONS[1:], start=2):
        new = {"role": "user", "content": question}
        got = client.chat.completions.create(
            model="tiny",
            messages=[new],
            max_tokens=12,
            temperature=0,
            extra_body={"session_id": sid},
        )
        history.append(new)
        want = client.chat.completions.create(
            model="tiny", messages=history, max_tokens=12, temperature=0
        )
        text = got.choices[0].message.content
        assert text == want.choices[0].message.content, f"turn {turn} differs"
        usage = got.usage
        assert usage is not None and usage.prompt_tokens == want.usage.prompt_tokens
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached >= 0.9 * usage.prompt_tokens, f"turn {turn}: {cached}/{usage.prompt_tokens}"
        assert extra(got, "session")["session_id"] == sid
        history.append({"role": "assistant", "content": text})

    with stack.client() as http:
        info = http.get(f"/v1/context/{sid}").json()
    assert info["turns"] == 5 and info["object"] == "context"
    assert info["context_tokens"] > 400 and "messages" not in info


def test_completion_session_equals_full_prompt(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    prompt = "Notes on caching." + DOC
    with stack.client() as http:
        r = http.post(
            "/v1/context",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0},
        )
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    ids = r.json()
    text = prompt + ids["choices"][0]["text"]
    for turn in range(2, 6):
        new = f" Question {turn}: and then"
        got = client.completions.create(
            model="tiny", prompt=new, max_tokens=10, temperature=0, extra_body={"session_id": sid}
        )
        text += new
        want = client.completions.create(model="tiny", prompt=text, max_tokens=10, temperature=0)
        assert got.choices[0].text == want.choices[0].text, f"turn {turn} differs"
        usage = got.usage
        assert usage is not None and usage.prompt_tokens == want.usage.prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens >= 0.9 * usage.prompt_tokens
        text += got.choices[0].text


async def test_async_and_streaming_session_turns(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="key-a", max_retries=0)
    with stack.client() as http:
        r = http.post(
            "/v1/context",
            json={"model": "tiny", "messages": [{"role": "system", "content": DOC}], "ttl": 300},
        )
    sid = r.json()["session_id"]
    assert r.json()["choices"] == []  # max_tokens 0: prefill only

    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Summarize."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"session_id": sid},
    )
    pieces, last = [], None
    async for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        last = chunk
    assert last is not None and last.usage is not None
    session = extra(last, "session")
    assert session["session_id"] == sid and session["context_tokens"] > 100

    full = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": DOC}, {"role": "user", "content": "Summarize."}],
        max_tokens=8,
        temperature=0,
    )
    assert "".join(pieces) == full.choices[0].message.content
    turn2 = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "More."}],
        max_tokens=4,
        temperature=0,
        extra_body={"session_id": sid},
    )
    assert turn2.usage.prompt_tokens_details.cached_tokens >= 0.9 * turn2.usage.prompt_tokens
    await client.close()


@pytest.mark.parametrize("header", [True, False])
def test_session_id_in_header_or_body(stack: Stack, header: bool) -> None:
    with stack.client() as http:
        sid = http.post("/v1/context", json={"model": "tiny", "prompt": DOC}).json()["session_id"]
        body: dict[str, Any] = {"model": "tiny", "prompt": " more", "max_tokens": 2}
        headers = {"x-session-id": sid} if header else {}
        if not header:
            body["session_id"] = sid
        r = http.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["session"]["session_id"] == sid


@pytest.mark.parametrize("chat", [True, False])
async def test_a_stream_without_a_session_is_the_workers_own(stack: Stack, chat: bool) -> None:
    """Relayed as the worker's bytes (`gateway.completions.streams.relayed`): the
    same text as the answer in one piece, the worker's usage chunk when asked for, and
    nothing of ours (no `session`). A chat request opts out of implicit sessions
    (`prompt_cache_options.mode: explicit`, docs/implicit.md), which would serve it."""
    relayed_before = relayed_streams(httpx, stack.url)
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="key-a", max_retries=0)
    common: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 0}
    if chat:
        create: Any = client.chat.completions.create
        common["messages"] = [{"role": "user", "content": "Tell me about caches."}]
        common["extra_body"] = {"prompt_cache_options": {"mode": "explicit"}}
    else:
        create = client.completions.create
        common["prompt"] = DOC
    whole = await create(**common)
    stream = await create(**common, stream=True, stream_options={"include_usage": True})
    pieces, last = [], None
    async for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            pieces.append((choice.delta.content if chat else choice.text) or "")
        last = chunk
    want = whole.choices[0].message.content if chat else whole.choices[0].text
    assert "".join(pieces) == want
    assert last is not None and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert extra(last, "session") is None
    await client.close()
    assert relayed_streams(httpx, stack.url) == relayed_before + 1
