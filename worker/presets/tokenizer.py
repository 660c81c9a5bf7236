"""A real byte-level BPE tokenizer trained offline on the running Python's stdlib source.

Deterministic: the corpus is the stdlib's top-level `*.py` files in sorted order, cut at
a fixed number of characters, so the same Python gives the same tokenizer.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS)

# ChatML, as Qwen2 writes it: a message per `<|im_start|>role\n...<|im_end|>\n` block.
# With tools, Qwen2.5's (Hermes) format, so that vLLM's `hermes` tool parser reads the
# output: the tools in a system block (merged with a leading system message), an assistant
# call as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` (the format vLLM's
# structural tag forces for a required or named `tool_choice`), each tool result in a user
# block of its own (one block per message keeps the template append-only). Without tools
# or tool messages the output is plain ChatML, byte for byte.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTION = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _jinja_str(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "\\'") + "'"


# The pieces the plain template shares with the thinking one (worker/presets/think.py): the
# tools' system block; inside the messages' loop, a leading system message merged into it
# and each tool result in a user block; an assistant message's calls (after the `for`
# over them, which each template opens its own way) with its end of turn; any other
# message as it is.
TOOLS_BLOCK = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ " + _jinja_str(TOOLS_PREAMBLE) + " }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ " + _jinja_str(TOOLS_INSTRUCTION) + " + '<|im_end|>\\n' }}"
    "{% endif %}"
)
TOOL_MESSAGES = (
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content']"
    " + '\\n</tool_response><|im_end|>\\n' }}"
)
CALL_AND_END = (
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}"
    "{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
)

CHAT_TEMPLATE = (
    TOOLS_BLOCK
    + "{% for message in messages %}"
    + TOOL_MESSAGES
    + "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    + CALL_AND_END
    + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2's pre-tokenizer (transformers' Qwen2Tokenizer rebuilds exactly this pipeline when it
# loads the directory, so training with it keeps `tokenizer.json` and AutoTokenizer in step).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_WORD = re.compile(r"^ [A-Za-z]+$")


def stdlib_corpus(max_chars: int) -> list[str]:
    """The stdlib's top-level modules, sorted by name, up to `max_chars` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text[: max_chars - total])
        total += len(texts[-1])
        if total >= max_chars:
            break
    return texts


def train_tokenizer(vocab_size: int, corpus_chars: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_corpus(corpus_chars), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )


def self_retokenizing_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Ids the output layer may produce: whole words `' [A-Za-z]+'` that encode to themselves.

    A run of such words decodes to text that the byte-level pre-tokenizer splits back at the
    spaces, and each word encodes to its own single id, so any sequence of them round-trips.
    The end-of-turn token is allowed too (it is special, so it round-trips as itself).
    """
    allowed: list[int] = []
    for token, token_id in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        text = tokenizer.convert_tokens_to_string([token])
        if _WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            allowed.append(token_id)
    allowed.append(int(tokenizer.convert_tokens_to_ids(EOS)))
    return sorted(set(allowed))
