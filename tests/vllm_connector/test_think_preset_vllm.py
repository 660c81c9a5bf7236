"""The thinking preset on the real vLLM (`tiny-think`, `--reasoning-parser qwen3`, its think
script), through the `openai` SDK: the reasoning in the message's `reasoning` field (vLLM
0.32's name), `content` free of `<think>`, streamed and not; thinking off through
`chat_template_kwargs`; a forced tool call after the reasoning; the script on
`/v1/completions` too (a session turn's prompt is token ids). Mostly vLLM itself, and the
gateway's plain (session-less) chat once, where the answer must be vLLM's."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack
from tests.vllm_connector.test_agents_vllm import WEATHER  # the agents' own tool
from worker.model_kind import KIND_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(VLLM_TIMEOUT)]
log = logging.getLogger(__name__)

MODEL = "tiny-think"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 48}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MARKUP = ("<think>", "</think>")


@pytest.fixture(scope="module")
def vllm(think_stack: VllmStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{think_stack.vllm.url}/v1", api_key="x", timeout=300)


def reasoning_of(message: Any) -> str | None:
    """vLLM's `reasoning` field (an extra of the SDK's models)."""
    return (message.model_extra or {}).get("reasoning")


def words(text: str | None) -> list[str]:
    return (text or "").split()


def test_the_reasoning_comes_in_its_own_field(vllm: openai.OpenAI, think_model: Any) -> None:
    start = time.monotonic()
    out = vllm.chat.completions.create(model=MODEL, messages=ASK, **GREEDY)
    took = time.monotonic() - start
    message = out.choices[0].message
    reasoning = reasoning_of(message)
    think_tokens = json.loads((think_model / KIND_FILE).read_text())["think_tokens"]
    log.info(
        "thinking answer in %.2f s: %d completion tokens, reasoning %r, content %r",
        took,
        out.usage.completion_tokens if out.usage else -1,
        reasoning,
        message.content,
    )
    # the script's length of the model's own words, then the model's answer
    assert len(words(reasoning)) == think_tokens
    assert message.content and words(message.content)
    assert not any(m in message.content or m in (reasoning or "") for m in MARKUP)
    assert out.usage is not None and out.usage.completion_tokens > think_tokens + 5


def test_streamed_the_reasoning_comes_first_and_is_the_same(vllm: openai.OpenAI) -> None:
    whole = vllm.chat.completions.create(model=MODEL, messages=ASK, **GREEDY).choices[0].message
    pieces: list[tuple[str, str]] = []
    stream = vllm.chat.completions.create(model=MODEL, messages=ASK, stream=True, **GREEDY)
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if text := reasoning_of(delta):
            pieces.append(("reasoning", text))
        if delta.content:
            pieces.append(("content", delta.content))
    kinds = [k for k, _ in pieces]
    assert kinds and kinds[0] == "reasoning" and "content" in kinds
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning")  # no reasoning after content
    assert "".join(t for k, t in pieces if k == "reasoning") == reasoning_of(whole)
    assert "".join(t for k, t in pieces if k == "content") == whole.content


def test_thinking_off_gives_no_reasoning(vllm: openai.OpenAI) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    out = vllm.chat.completions.create(model=MODEL, messages=ASK, extra_body=off, **GREEDY)
    message = out.choices[0].message
    assert not reasoning_of(message)
    assert message.content and not any(m in message.content for m in MARKUP)
    # `reasoning_effort: none` is the same for the template and for vLLM's parser
    effort = vllm.chat.completions.create(
        model=MODEL, messages=ASK, reasoning_effort="none", **GREEDY
    ).choices[0]
    assert not reasoning_of(effort.message) and effort.message.content == message.content


def test_a_request_may_think_shorter(vllm: openai.OpenAI) -> None:
    body = {"vllm_xargs": {"think_tokens": 3}}
    out = vllm.chat.completions.create(model=MODEL, messages=ASK, extra_body=body, **GREEDY)
    assert len(words(reasoning_of(out.choices[0].message))) == 3
    bad = {"vllm_xargs": {"think_tokens": -2}}
    with pytest.raises(openai.BadRequestError, match="think_tokens"):
        vllm.chat.completions.create(model=MODEL, messages=ASK, extra_body=bad, **GREEDY)


def test_a_forced_tool_call_comes_after_the_reasoning(vllm: openai.OpenAI) -> None:
    """`tool_choice: required`: vLLM's grammar starts at `</think>` (the script's blank line
    after it yields to the grammar) and writes one call (`parallel_tool_calls: false`;
    random weights would go on calling until `max_tokens`), streamed or not."""
    forced: dict[str, Any] = {
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        **{**GREEDY, "max_tokens": 160},  # a call is ~75 tokens: `<tool_call>` is no token
    }
    out = vllm.chat.completions.create(model=MODEL, messages=ASK, **forced)
    choice = out.choices[0]
    log.info(
        "forced call: %r, reasoning %r, usage %r",
        choice.message.tool_calls,
        reasoning_of(choice.message),
        out.usage,
    )
    assert choice.finish_reason == "tool_calls" and words(reasoning_of(choice.message))
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert not any(m in (choice.message.content or "") for m in MARKUP)
    kinds: list[str] = []
    for chunk in vllm.chat.completions.create(model=MODEL, messages=ASK, stream=True, **forced):
        for c in chunk.choices:
            kinds += ["reasoning"] if reasoning_of(c.delta) else []
            kinds += ["tool_calls"] if c.delta.tool_calls else []
    assert kinds and kinds[0] == "reasoning" and kinds[-1] == "tool_calls"
    assert "reasoning" not in kinds[kinds.index("tool_calls") :]


def test_the_script_runs_on_completions_of_token_ids(
    think_stack: VllmStack, vllm: openai.OpenAI, think_model: Any
) -> None:
    """A session turn's prompt: the rendered conversation as token ids, on /v1/completions."""
    tok = AutoTokenizer.from_pretrained(think_model)
    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    out = vllm.completions.create(model=MODEL, prompt=ids, **GREEDY)
    text = out.choices[0].text
    chat = vllm.chat.completions.create(model=MODEL, messages=ASK, **GREEDY).choices[0].message
    head, _, answer = text.partition("\n</think>\n\n")
    assert head.startswith("<think>\n") and answer
    assert head.removeprefix("<think>\n").split() == words(reasoning_of(chat))
    assert answer.split() == words(chat.content)


def test_the_gateway_passes_a_plain_request_through(
    think_stack: VllmStack, vllm: openai.OpenAI
) -> None:
    direct = vllm.chat.completions.create(model=MODEL, messages=ASK, **GREEDY).choices[0].message
    gateway = openai.OpenAI(base_url=f"{think_stack.url}/v1", api_key="x", timeout=300)
    through = gateway.chat.completions.create(model=MODEL, messages=ASK, **GREEDY)
    message = through.choices[0].message
    assert reasoning_of(message) == reasoning_of(direct)
    assert message.content == direct.content
