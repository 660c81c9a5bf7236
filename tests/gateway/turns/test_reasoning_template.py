"""A session's prompts under the real thinking template (the `tiny-think` preset's, Qwen3's
rule: worker/presets/think.py), rendered by transformers as a worker's `/tokenize` renders
it, with a small tokenizer trained here: no engine. The same turns run on the real vLLM in
tests/vllm_connector/test_reasoning_vllm.py."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from gateway.pool import Worker
from gateway.prompts import PromptBuilder
from gateway.reasoning import rebased
from worker.presets.think import thinking_tokenizer
from worker.presets.tokenizer import EOS, train_tokenizer

Messages = list[dict[str, Any]]
SYSTEM = {"role": "system", "content": "be brief"}
U1 = {"role": "user", "content": "hello"}
U2 = {"role": "user", "content": "and then?"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"role": "tool", "tool_call_id": "c1", "content": "42"}


@cache
def tokenizer() -> PreTrainedTokenizerFast:
    return thinking_tokenizer(train_tokenizer(512, 100_000))


def ids(text: str) -> list[int]:
    return list(tokenizer().encode(text, add_special_tokens=False))


class Rendering(PromptBuilder):
    """`/tokenize` as vLLM's: the template rendered, then tokenized without special tokens."""

    async def tokenize(self, worker: Worker, body: dict[str, Any]) -> tuple[list[int], int]:
        text = tokenizer().apply_chat_template(
            body["messages"],
            tools=body.get("tools"),
            tokenize=False,
            add_generation_prompt=body["add_generation_prompt"],
            continue_final_message=body.get("continue_final_message", False),
            **(body.get("chat_template_kwargs") or {}),
        )
        return ids(text), 4096  # type: ignore[arg-type]


async def session(generated: str) -> tuple[Rendering, list[int]]:
    """A session's stored ids after its first turn: the model thought, then answered."""
    prompts = Rendering()
    prompt, _ = await prompts.chat(None, "m", [SYSTEM, U1], generation_prompt=True)  # type: ignore[arg-type]
    eos = int(tokenizer().convert_tokens_to_ids(EOS))
    return prompts, prompt + ids(generated) + [eos]


async def test_keep_sends_the_closed_answer_once() -> None:
    """Under `keep` the stored ids stay; the template renders the closed answer without its
    block, which must not make it come again after them."""
    prompts, stored = await session("<think>\nhmm ok\n</think>\n\nhi there")
    answer = {"role": "assistant", "content": "hi there", "reasoning": "hmm ok"}
    history = [SYSTEM, U1, answer]
    rendered = await prompts.chat_full(None, "m", history, [U2])  # type: ignore[arg-type]
    assert rendered[0][: len(stored)] != stored  # the template dropped the reasoning
    new, _ = await prompts.delta(None, "m", stored, history, rendered)  # type: ignore[arg-type]
    assert new == ids("\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n")


async def test_template_rebases_on_the_stateless_clients_prompt() -> None:
    prompts, stored = await session("<think>\nhmm ok\n</think>\n\nhi there")
    answer = {"role": "assistant", "content": "hi there", "reasoning": "hmm ok"}
    rendered = await prompts.chat_full(None, "m", [SYSTEM, U1, answer], [U2])  # type: ignore[arg-type]
    # what a client without a session sends: the answer's content only
    stateless, _ = await prompts.chat(
        None,  # type: ignore[arg-type]
        "m",
        [SYSTEM, U1, {"role": "assistant", "content": "hi there"}, U2],
        generation_prompt=True,
    )
    assert rebased(stored, rendered[0]) == stateless


@pytest.mark.parametrize("kept", [True, False])
async def test_a_tool_result_follows_the_exact_ids_once(kept: bool) -> None:
    """Inside the chain the template shows the reasoning (kept in the history: the stored
    ids are the rendering's own prefix); without it, the new part is read from the end."""
    generated = (
        '<think>\nneed f\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    )
    prompts, stored = await session(generated)
    call: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    if kept:
        call["reasoning"] = "need f"
    history = [SYSTEM, U1, call]
    rendered = await prompts.chat_full(None, "m", history, [TOOL])  # type: ignore[arg-type]
    assert (rendered[0][: len(stored)] == stored) is kept
    new, _ = await prompts.delta(None, "m", stored, history, rendered)  # type: ignore[arg-type]
    after = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    assert new == ids("\n" + after + "<|im_start|>assistant\n")


async def test_thinking_off_closes_an_empty_block_in_the_generation_prompt() -> None:
    prompts = Rendering()
    off, _ = await prompts.chat(
        None,  # type: ignore[arg-type]
        "m",
        [SYSTEM, U1],
        generation_prompt=True,
        kwargs={"enable_thinking": False},
    )
    on, _ = await prompts.chat(None, "m", [SYSTEM, U1], generation_prompt=True)  # type: ignore[arg-type]
    assert off == on + ids("<think>\n\n</think>\n\n")
