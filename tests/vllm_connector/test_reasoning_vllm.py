"""Reasoning models on a session, end to end on the real vLLM with the thinking preset
(`tiny-think`: Qwen3's `<think>` template, vLLM's `qwen3` reasoning parser, the think
script that makes the random model close its thinking), float32 and greedy, so that a
session's answer can be compared with vLLM's to the whole conversation
(docs/reasoning.md): the reasoning in its own field for the openai SDK, streamed and not;
under `template` the answer after a new user message is the stateless one and only the
closed turn is computed again; under `keep` every turn reuses its history but one block;
a chain of tool calls keeps its reasoning; implicit sessions follow the template; bad
inputs change nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.utils import metric
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, document
from tests.vllm_connector.test_agents_vllm import WEATHER  # the agents' own tool

pytestmark = [pytest.mark.slow, pytest.mark.timeout(VLLM_TIMEOUT)]
MODEL = "tiny-think"
BLOCK = 128  # vLLM's CPU block: what a turn may recompute beyond its new part
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 40}
EXPLICIT = {"prompt_cache_options": {"mode": "explicit"}}  # (no implicit session: vLLM's own)
REBASES = "ctxcache_gateway_reasoning_rebases_total"


@pytest.fixture(scope="module")
def stack(think_stack: VllmStack) -> VllmStack:
    """The shared tiny-think stack (float32, eager; `think_stack`): one engine start for
    every reasoning module."""
    return think_stack


@pytest.fixture
def client(stack: VllmStack) -> Iterator[openai.OpenAI]:
    # (retries: on a loaded 2-CPU machine the gateway may find vLLM's /health late and
    # answer 503 `no healthy inference worker` before anything ran)
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=3) as c:
        yield c


def create(stack: VllmStack, seed: int, **fields: Any) -> str:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": document(seed, 200)}],
        **fields,
    }
    got = stack.http.post("/v1/context", json=body)
    assert got.status_code == 200, got.text
    return str(got.json()["session_id"])


def system(seed: int) -> dict[str, str]:
    return {"role": "system", "content": document(seed, 200)}


def context(stack: VllmStack, sid: str) -> dict[str, Any]:
    got = stack.http.get(f"/v1/context/{sid}")
    assert got.status_code == 200, got.text
    return dict(got.json())


def thought(message: Any) -> str:
    """The message's reasoning, checked: its own field, and none of it in the content."""
    reasoning = getattr(message, "reasoning", None)
    assert isinstance(reasoning, str) and reasoning.strip(), message
    assert "<think>" not in (message.content or "") and "</think>" not in (message.content or "")
    return reasoning


def streamed(stream: Any) -> tuple[str, str, Any]:
    """A stream's reasoning, content and usage."""
    reasoning, content, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            reasoning.append(getattr(c.delta, "reasoning", None) or "")
            content.append(c.delta.content or "")
    return "".join(reasoning), "".join(content), usage


def cached(usage: Any) -> int:
    return int(usage.prompt_tokens_details.cached_tokens)


def say(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def answered(message: Any) -> dict[str, Any]:
    """What a stateless client sends back of an answer: its content (and calls)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls
        ]
    return out


def test_the_openai_sdk_gets_the_reasoning_in_its_own_field(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    """Session turns (the second one's prompt holds the first's `</think>`: the split is
    right on it too), streamed and not, and the same without a session."""
    sid = create(stack, 1)
    extra = {"session_id": sid}
    r1 = client.chat.completions.create(
        model=MODEL, messages=say("hello"), extra_body=extra, **GREEDY
    )
    thought(r1.choices[0].message)
    reasoning, content, usage = streamed(
        client.chat.completions.create(
            model=MODEL,
            messages=say("and then?"),
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            **GREEDY,
        )
    )
    assert reasoning.strip() and "<think>" not in content and "</think>" not in content
    assert usage.completion_tokens > 0
    r3 = client.chat.completions.create(
        model=MODEL, messages=say("one more"), extra_body=extra, **GREEDY
    )
    thought(r3.choices[0].message)
    assert context(stack, sid)["turns"] == 4

    plain = [system(1), *say("hello")]
    thought(
        client.chat.completions.create(model=MODEL, messages=plain, extra_body=EXPLICIT, **GREEDY)
        .choices[0]
        .message
    )
    reasoning, content, _ = streamed(
        client.chat.completions.create(
            model=MODEL, messages=plain, stream=True, extra_body=EXPLICIT, **GREEDY
        )
    )
    assert reasoning.strip() and "</think>" not in content


def test_template_answers_as_the_whole_conversation_and_recomputes_the_closed_turn(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    """Each user turn: the session's answer is vLLM's to the whole conversation sent
    without a session (the closed turns' content only); the prompt is the same; what is
    computed again is the closed turn's answer and the new input, within one block."""
    sid = create(stack, 2)
    assert context(stack, sid)["reasoning_history"] == "template"
    whole: list[dict[str, Any]] = [system(2)]
    last_prompt = None
    for i, text in enumerate(["hello there", "tell me more", "and after that?"]):
        before = metric(stack.http.get("/metrics").text, REBASES)
        turn = client.chat.completions.create(
            model=MODEL, messages=say(text), extra_body={"session_id": sid}, **GREEDY
        )
        whole += say(text)
        plain = client.chat.completions.create(
            model=MODEL, messages=whole, extra_body=EXPLICIT, **GREEDY
        )
        got, want = turn.choices[0].message, plain.choices[0].message
        assert (thought(got), got.content) == (thought(want), want.content), i
        assert turn.usage.prompt_tokens == plain.usage.prompt_tokens
        rebases = metric(stack.http.get("/metrics").text, REBASES) - before
        assert rebases == (1 if i else 0)  # every turn after the first closes one
        if last_prompt is not None:  # the closed turn began where its prompt ended
            assert cached(turn.usage) >= last_prompt - BLOCK, (turn.usage, last_prompt)
        last_prompt = turn.usage.prompt_tokens
        info = context(stack, sid)
        assert info["context_tokens"] == turn.usage.prompt_tokens + turn.usage.completion_tokens
        whole.append(answered(got))


def test_keep_reuses_the_whole_history_but_one_block(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    sid = create(stack, 3, reasoning_history="keep")
    assert context(stack, sid)["reasoning_history"] == "keep"
    before = metric(stack.http.get("/metrics").text, REBASES)
    for text in ["hello there", "tell me more", "and after that?"]:
        history = context(stack, sid)["context_tokens"]
        turn = client.chat.completions.create(
            model=MODEL, messages=say(text), extra_body={"session_id": sid}, **GREEDY
        )
        thought(turn.choices[0].message)
        assert cached(turn.usage) >= history - BLOCK, (turn.usage, history)
        assert turn.usage.prompt_tokens > history  # the exact ids, thinking included, stay
    assert metric(stack.http.get("/metrics").text, REBASES) == before


def test_a_chain_of_tool_calls_keeps_its_reasoning_until_the_next_user_message(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    sid = create(stack, 4, tools=[WEATHER])
    extra = {"session_id": sid}
    before = metric(stack.http.get("/metrics").text, REBASES)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r1 = client.chat.completions.create(
        model=MODEL,
        messages=say("weather in rome?"),
        tool_choice=named,  # type: ignore[arg-type]
        extra_body=extra,
        **{**GREEDY, "max_tokens": 160},  # (the thinking, then the whole call)
    )
    thought(r1.choices[0].message)
    (call,) = r1.choices[0].message.tool_calls or []
    history = context(stack, sid)["context_tokens"]
    result = [{"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model=MODEL, messages=result, extra_body=extra, **GREEDY)  # type: ignore[arg-type]
    thought(r2.choices[0].message)
    assert cached(r2.usage) >= history - BLOCK, (r2.usage, history)
    assert metric(stack.http.get("/metrics").text, REBASES) == before  # the chain: kept
    r3 = client.chat.completions.create(
        model=MODEL, messages=say("thanks"), extra_body=extra, **GREEDY
    )
    assert metric(stack.http.get("/metrics").text, REBASES) == before + 1
    whole = [
        system(4),
        *say("weather in rome?"),
        answered(r1.choices[0].message),
        *result,
        answered(r2.choices[0].message),
        *say("thanks"),
    ]
    plain = client.chat.completions.create(
        model=MODEL,
        messages=whole,
        tools=[WEATHER],
        extra_body=EXPLICIT,
        **GREEDY,  # type: ignore[list-item]
    )
    got, want = r3.choices[0].message, plain.choices[0].message
    assert (got.reasoning, got.content) == (want.reasoning, want.content)  # type: ignore[attr-defined]
    assert r3.usage.prompt_tokens == plain.usage.prompt_tokens  # type: ignore[union-attr]


def test_an_implicit_session_follows_the_template(stack: VllmStack, client: openai.OpenAI) -> None:
    """A stateless client sends its closed turns back without their reasoning: its
    conversation is still found, served as a turn, and re-based like an explicit one."""
    whole: list[dict[str, Any]] = [system(5)]
    last_prompt = None
    for i, text in enumerate(["hello there", "tell me more", "and after that?"]):
        hits = metric(
            stack.http.get("/metrics").text,
            'ctxcache_gateway_implicit_total{result="hit"}',
        )
        whole += say(text)
        turn = client.chat.completions.create(model=MODEL, messages=whole, **GREEDY)
        plain = client.chat.completions.create(
            model=MODEL, messages=whole, extra_body=EXPLICIT, **GREEDY
        )
        got, want = turn.choices[0].message, plain.choices[0].message
        assert (thought(got), got.content) == (thought(want), want.content), i
        after = metric(
            stack.http.get("/metrics").text,
            'ctxcache_gateway_implicit_total{result="hit"}',
        )
        assert after - hits == (1 if i else 0), i
        if last_prompt is not None:
            assert cached(turn.usage) >= last_prompt - BLOCK, (turn.usage, last_prompt)
        last_prompt = turn.usage.prompt_tokens
        whole.append(answered(got))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
        ({"include_reasoning": "no"}, "include_reasoning"),
    ],
)
def test_bad_reasoning_inputs_are_refused_and_change_nothing(
    stack: VllmStack, fields: dict[str, Any], param: str
) -> None:
    sid = create(stack, 6)
    turn = {"model": MODEL, "messages": say("hello"), "session_id": sid, **GREEDY}
    assert stack.http.post("/v1/chat/completions", json=turn).status_code == 200
    before = context(stack, sid)
    got = stack.http.post("/v1/chat/completions", json={**turn, **fields})
    assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    after = context(stack, sid)
    assert (after["turns"], after["context_tokens"]) == (before["turns"], before["context_tokens"])
    # the next turn runs as if the refused one had never come (a user turn: re-based)
    again = stack.http.post("/v1/chat/completions", json={**turn, "messages": say("again")})
    assert again.status_code == 200, again.text


def test_thinking_turned_off_answers_without_reasoning(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    sid = create(stack, 7)
    r = client.chat.completions.create(
        model=MODEL,
        messages=say("hello"),
        reasoning_effort="none",  # type: ignore[arg-type]
        extra_body={"session_id": sid},
        **GREEDY,
    )
    assert getattr(r.choices[0].message, "reasoning", None) is None
    plain = client.chat.completions.create(
        model=MODEL,
        messages=[system(7), *say("hello")],
        reasoning_effort="none",  # type: ignore[arg-type]
        extra_body=EXPLICIT,
        **GREEDY,
    )
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # (the empty block in both)
