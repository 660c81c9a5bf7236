"""The presets' chat template: plain ChatML without tools, Hermes (Qwen2.5) tool calls with
them, append-only either way, and read back by vLLM's own `hermes` tool parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from worker.presets.tokenizer import CHAT_TEMPLATE

# The template before tools, verbatim: without tools the output must not move by a byte.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(tiny_model)


def render(tok: Any, messages: list[dict], **kw: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def ids(tok: Any, messages: list[dict], **kw: Any) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_the_preset_ships_this_template(tok: PreTrainedTokenizerFast) -> None:
    assert tok.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": ""},
            {"role": "system", "content": "late"},
        ],
    ],
)
@pytest.mark.parametrize("gen", [True, False])
def test_without_tools_the_rendering_is_plain_chatml(
    tok: PreTrainedTokenizerFast, messages: list[dict], gen: bool
) -> None:
    want = render(tok, messages, add_generation_prompt=gen, chat_template=CHATML)
    assert render(tok, messages, add_generation_prompt=gen) == want
    assert render(tok, messages, add_generation_prompt=gen, tools=None) == want
    assert render(tok, messages, add_generation_prompt=gen, tools=[]) == want
    if not gen and messages[-1]["role"] == "assistant":
        cont = {"continue_final_message": True}
        assert render(tok, messages, **cont) == render(tok, messages, chat_template=CHATML, **cont)


def test_tools_get_a_system_block_of_their_own(tok: PreTrainedTokenizerFast) -> None:
    text = render(
        tok, [{"role": "user", "content": "hi"}], tools=[WEATHER, TIME], add_generation_prompt=True
    )
    head, rest = text.split("<|im_end|>\n", 1)
    assert head.startswith("<|im_start|>system\n# Tools\n")
    listed = head.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.split("\n")] == [WEATHER, TIME]
    assert head.endswith(
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    assert rest == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_leading_system_message_is_merged_with_the_tools(tok: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render(tok, messages, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1 and text.count("Be brief.") == 1
    assert text.endswith("<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")


def test_an_assistant_tool_call(tok: PreTrainedTokenizerFast) -> None:
    user = [{"role": "user", "content": "weather?"}]
    second = {
        "id": "call_2",
        "type": "function",
        "function": {"name": "get_time", "arguments": {}},  # a dict: rendered as JSON
    }
    for content, prefix in ((None, ""), ("", ""), ("Let me look.", "Let me look.")):
        msg = {"role": "assistant", "content": content, "tool_calls": [CALL, second]}
        text = render(tok, [*user, msg], tools=[WEATHER, TIME])
        prompt = render(tok, user, tools=[WEATHER, TIME], add_generation_prompt=True)
        assert text[len(prompt) :] == (
            f"{prefix}<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            "<tool_call>\n"
            '{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        )
    # arguments as a string go in verbatim, whatever their spacing
    odd = {**CALL, "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}
    text = render(tok, [*user, {"role": "assistant", "tool_calls": [odd]}])
    assert '{"name": "get_weather", "arguments": {"city":"Rome"}}\n' in text


def test_each_tool_message_is_a_user_block_of_its_own(tok: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"t": 21}'},
    ]
    text = render(tok, messages, tools=[WEATHER], add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"t": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_the_template_is_append_only_with_tools(tok: PreTrainedTokenizerFast) -> None:
    conversation = [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [CALL, {**CALL, "id": "call_2", "function": {**CALL["function"]}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "assistant", "content": "Paris is sunny, Rome rainy."},
        {"role": "user", "content": "thanks"},
    ]
    for tools in ([WEATHER], None):
        for k in range(1, len(conversation)):
            head, longer = conversation[:k], conversation[: k + 1]
            assert render(tok, longer, tools=tools).startswith(render(tok, head, tools=tools))
            short, full = ids(tok, head, tools=tools), ids(tok, longer, tools=tools)
            assert full[: len(short)] == short, f"tokens move at message {k}"
            # the generation prompt is where the next assistant message starts
            if longer[-1]["role"] == "assistant":
                prompt = render(tok, head, tools=tools, add_generation_prompt=True)
                assert render(tok, longer, tools=tools).startswith(prompt)


def test_vllm_hermes_parser_reads_a_rendered_call(tok: PreTrainedTokenizerFast) -> None:
    hermes = pytest.importorskip("vllm.tool_parsers.hermes_tool_parser")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    user = [{"role": "user", "content": "weather?"}]
    two = [CALL, {**CALL, "function": {"name": "get_time", "arguments": "{}"}}]
    for content in (None, "Let me look."):
        msg = {"role": "assistant", "content": content, "tool_calls": two}
        prompt = render(tok, user, tools=[WEATHER, TIME], add_generation_prompt=True)
        generated = render(tok, [*user, msg], tools=[WEATHER, TIME])[len(prompt) :]
        generated = generated.removesuffix("<|im_end|>\n")  # vLLM stops at the EOS
        request = ChatCompletionRequest(
            model="tiny", messages=user, tools=[WEATHER, TIME], tool_choice="auto"
        )
        parsed = hermes.Hermes2ProToolParser(tok).extract_tool_calls(generated, request)
        assert parsed.tools_called and parsed.content == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": "Paris"}),
            ("get_time", {}),
        ]
        # what vLLM answers renders back to the text the model wrote
        answer = {
            "role": "assistant",
            "content": parsed.content,
            "tool_calls": [c.model_dump() for c in parsed.tool_calls],
        }
        rendered = render(tok, [*user, answer], tools=[WEATHER, TIME])
        assert rendered == prompt + generated + "<|im_end|>\n"
