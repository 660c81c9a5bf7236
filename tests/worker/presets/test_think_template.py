"""The thinking preset's tokenizer and template: `<think>`/`</think>` tokens, Qwen3's rule for
past reasoning (kept inside the open turn's tool-call chain, dropped for closed turns),
`enable_thinking`, the presets' Hermes tool calls, and vLLM's `qwen3` parser reading what
the model writes back into messages that render to the same tokens."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tests.worker.presets.test_chat_template import CALL, CHATML, WEATHER
from tests.worker.presets.test_model import _digest
from worker.model_kind import KIND_FILE, preset_of
from worker.presets import create_model
from worker.presets.think import THINK_CHAT_TEMPLATE
from worker.presets.tokenizer import CHAT_TEMPLATE

USER = {"role": "user", "content": "q"}
CALLS = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


@pytest.fixture(scope="module")
def tok(think_model: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(think_model)


@pytest.fixture(scope="module")
def plain(tiny_model: Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(tiny_model)


def render(tok: Any, messages: list[dict], **kw: Any) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


def encode(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def test_the_preset_is_qwen3_with_think_tokens_and_the_thinking_template(
    tok: PreTrainedTokenizerFast, plain: PreTrainedTokenizerFast, think_model: Path
) -> None:
    config = json.loads((think_model / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert preset_of(think_model) == ("tiny-think", "dense")
    assert tok.chat_template == THINK_CHAT_TEMPLATE
    assert plain.chat_template == CHAT_TEMPLATE  # the other presets' template is untouched
    # two tokens of their own, after the size's vocabulary, kept in decoded text
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert (start, end) == (len(plain), len(plain) + 1) and config["vocab_size"] == len(tok)
    assert encode(tok, "<think>\n x</think>")[0] == start and encode(tok, "</think>") == [end]
    assert tok.decode([start, end], skip_special_tokens=True) == "<think></think>"
    # the same words otherwise: the plain tiny's ids for text without the markup
    assert encode(tok, "def main(): pass") == encode(plain, "def main(): pass")
    # the model's output layer cannot write them (the think script does)
    weights = load_file(str(think_model / "model.safetensors"))
    assert not weights["lm_head.weight"][[start, end]].any()
    record = json.loads((think_model / KIND_FILE).read_text())
    assert record["think"]["open"] == encode(tok, "<think>\n")
    assert record["think"]["close"] == encode(tok, "\n</think>\n\n")
    assert record["think"]["turn_start"] == encode(tok, "<|im_start|>assistant\n")


def test_same_thinking_preset_same_files(think_model: Path, tmp_path: Path) -> None:
    assert _digest(create_model("tiny-think", tmp_path / "again")) == _digest(think_model)


@pytest.mark.parametrize(
    "messages",
    [
        [USER],
        [{"role": "system", "content": "S"}, USER, {"role": "assistant", "content": "b"}, USER],
    ],
)
def test_without_reasoning_it_renders_as_the_plain_presets(
    tok: PreTrainedTokenizerFast, messages: list[dict]
) -> None:
    want = render(tok, messages, add_generation_prompt=True, chat_template=CHATML)
    assert render(tok, messages, add_generation_prompt=True) == want
    assert render(tok, messages, add_generation_prompt=True, enable_thinking=True) == want


def test_thinking_off_closes_an_empty_block_in_the_generation_prompt(
    tok: PreTrainedTokenizerFast,
) -> None:
    on = render(tok, [USER], add_generation_prompt=True)
    off = render(tok, [USER], add_generation_prompt=True, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"
    assert render(tok, [USER], enable_thinking=False) == render(tok, [USER])  # no prompt


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_closed_turns_lose_their_reasoning(tok: PreTrainedTokenizerFast, field: str) -> None:
    answered = {"role": "assistant", "content": " a", field: " r"}
    text = render(tok, [USER, answered, {"role": "user", "content": "next"}])
    assert "<think>" not in text and " r" not in text
    assert "<|im_start|>assistant\n a<|im_end|>\n" in text
    # the last message, after the last user one, keeps it (what the model wrote)
    assert render(tok, [USER, answered]).endswith(
        "<|im_start|>assistant\n<think>\n r\n</think>\n\n a<|im_end|>\n"
    )


def test_the_open_turns_tool_call_chain_keeps_its_reasoning(tok: PreTrainedTokenizerFast) -> None:
    thought = {**CALLS, "reasoning": "\n look it up\n"}
    chain = [USER, thought, RESULT]
    text = render(tok, chain, tools=[WEATHER], add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>assistant\n<think>\n look it up\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # once the next user message arrives, the chain is a closed turn: its reasoning goes
    later = render(tok, [*chain, {"role": "assistant", "content": " done"}, USER], tools=[WEATHER])
    assert "look it up" not in later and "<think>" not in later
    # a call without reasoning inside the chain gets no block (it is not the last message)
    bare = render(tok, [USER, CALLS, RESULT], tools=[WEATHER], add_generation_prompt=True)
    assert "<think>" not in bare


def test_reasoning_left_in_the_content_is_split_out(tok: PreTrainedTokenizerFast) -> None:
    raw = {"role": "assistant", "content": "<think>\n mulling\n</think>\n\n a"}
    assert render(tok, [USER, raw]) == render(
        tok, [USER, {"role": "assistant", "content": " a", "reasoning": " mulling"}]
    )
    closed = render(tok, [USER, raw, USER])
    assert "<|im_start|>assistant\n a<|im_end|>" in closed and "mulling" not in closed


def test_vllm_qwen3_parser_splits_what_the_model_writes_and_it_renders_back(
    tok: PreTrainedTokenizerFast,
) -> None:
    """The think script's shape, `<think>\\n` words `\\n</think>\\n\\n` answer, read by vLLM's
    parser into reasoning and content; those sent back as the open turn's message render
    to the very tokens the model wrote (the session keeps them; a stateless client's
    rendering matches them)."""
    pytest.importorskip("vllm")
    with warnings.catch_warnings():  # vLLM's imports warn about torch APIs of theirs
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.reasoning import ReasoningParserManager

    parser = ReasoningParserManager.get_reasoning_parser("qwen3")(tok)
    request = ChatCompletionRequest(model="m", messages=[USER])
    prompt = render(tok, [USER], tools=[WEATHER], add_generation_prompt=True)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for answer in (" sunny and warm", call):
        written = "<think>\n look it up\n</think>\n\n" + answer
        reasoning, content = parser.extract_reasoning(written, request)
        assert reasoning is not None and reasoning.strip() == "look it up"
        assert content is not None and "think>" not in content and content.endswith(answer)
        message: dict = {"role": "assistant", "content": content, "reasoning": reasoning}
        if answer == call:
            message = {**CALLS, "reasoning": reasoning}
        full = render(tok, [USER, message], tools=[WEATHER])
        assert full == prompt + written + "<|im_end|>\n"
        assert encode(tok, full) == encode(tok, prompt) + encode(tok, written + "<|im_end|>\n")
    # the prompt of the open chain does not count as reasoning ended (the earlier block is
    # behind a turn boundary): structured outputs wait for this turn's `</think>`
    chain = render(tok, [USER, {**CALLS, "reasoning": " r"}, RESULT], add_generation_prompt=True)
    assert not parser.is_reasoning_end(encode(tok, chain))
    off = render(tok, [USER], add_generation_prompt=True, enable_thinking=False)
    assert parser.is_reasoning_end(encode(tok, off))
