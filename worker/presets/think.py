"""The thinking presets' tokenizer and chat template (`tiny-think`, `small-think`): Qwen3's.

The tokenizer is the size's trained one with `<think>` and `</think>` added as tokens of
their own, not special (Qwen3's are not: they stay in the decoded text, and vLLM's `qwen3`
parser finds them by id in the vocabulary). The template is the presets' ChatML with
Hermes tool calls (tokenizer.py), plus Qwen3's thinking:
- the model writes `<think>\\n...\\n</think>\\n\\n` and then its answer;
- `enable_thinking=False` closes an empty block in the generation prompt
  (`<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`), as Qwen3's template does;
- an assistant message's reasoning (`reasoning_content`, or `reasoning`, the field vLLM
  0.32 hands its templates beside it; else a `<think>` block in its content) is rendered
  only after the last user message, inside the open turn's chain of tool calls; the closed
  turns before it lose their reasoning. The last message, when it is an assistant one after
  the last user message, always gets a block (empty without reasoning). Qwen3's rule,
  exactly; its `last_query_index` skips tool results sent as user messages, which this
  template sends as `tool` messages.
`script_record` writes the token ids worker/presets/think_script.py needs into the preset's
record, so that vLLM's processor reads one JSON file and no tokenizer.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

from worker.presets.tokenizer import (
    BOS,
    CALL_AND_END,
    EOS,
    PAD,
    TOOL_MESSAGES,
    TOOLS_BLOCK,
)

THINK_START, THINK_END = "<think>", "</think>"
REASONING_PARSER = "qwen3"  # vLLM's parser of this template's `<think>` blocks
SCRIPT = "worker.presets.think_script:ThinkScript"  # vLLM's --logits-processors entry
TURN_START = BOS + "assistant\n"  # the generation prompt; the script opens a block after it
OPEN = THINK_START + "\n"
CLOSE = "\n" + THINK_END + "\n\n"
EMPTY_BLOCK = OPEN + CLOSE.lstrip("\n")  # `<think>\n\n</think>\n\n`: thinking off

THINK_CHAT_TEMPLATE = (
    "{% set ns = namespace(last_query=messages | length - 1) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}"
    "{% endfor %}"
    + TOOLS_BLOCK
    + "{% for message in messages %}"
    + TOOL_MESSAGES
    + "{% elif message['role'] == 'assistant' %}"
    "{% set content = message['content'] or '' %}"
    "{% set reasoning = '' %}"
    "{% if message['reasoning_content'] is string %}"
    "{% set reasoning = message['reasoning_content'] %}"
    "{% elif message['reasoning'] is string %}"
    "{% set reasoning = message['reasoning'] %}"
    "{% elif '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{% endif %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{% else %}{{ content }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    + CALL_AND_END
    + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)


def thinking_tokenizer(base: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """A copy of `base` with `<think>` and `</think>` appended (ids `len(base)`, +1) and the
    thinking template; `base` (shared by the size's other presets) is left as it was."""
    backend = Tokenizer.from_str(base.backend_tokenizer.to_str())
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=THINK_CHAT_TEMPLATE,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )


def script_record(tokenizer: PreTrainedTokenizerFast, think_tokens: int) -> dict[str, object]:
    """What the think script forces, as token ids: after a prompt that ends in `turn_start`,
    `open`, then `think_tokens` tokens of the model's own (none of `banned`: no end of turn,
    no think markup), then `close`; the rest is the model's again."""

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    banned = [THINK_START, THINK_END, EOS]
    return {
        "turn_start": ids(TURN_START),
        "open": ids(OPEN),
        "close": ids(CLOSE),
        "think_tokens": think_tokens,
        "banned": [int(tokenizer.convert_tokens_to_ids(t)) for t in banned],
    }
