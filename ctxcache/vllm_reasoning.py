"""vLLM's reasoning parser for a model (`--reasoning-parser auto|NAME|none`; docs/vllm.md,
"Reasoning models"), and the logits processors a preset asks vLLM to load.

A reasoning parser splits what a thinking model writes into `reasoning` and `content`; on
a model that does not think it is harmful (Qwen3's parser, for one, files an answer with no
`<think>` block under reasoning). So `auto` picks a family's parser only where the model
thinks: gpt-oss always does (its harmony format); the other families have thinking and
non-thinking checkpoints under one `model_type` (Qwen3 vs Qwen3-Instruct-2507, DeepSeek-R1
vs DeepSeek-V3-0324, Kimi-K2-Thinking vs Kimi-K2-Instruct), and only the thinking ones'
chat templates write `<think>`. The presets record their parser (`ctxcache_preset.json`):
only the thinking preset has one. Reads JSON files only; imports neither torch nor vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

# config.json's `model_type` -> vLLM's --reasoning-parser, for a checkpoint that thinks
REASONING_PARSERS = {
    "qwen3": "qwen3",  # Qwen3 (thinking by default, `enable_thinking`), Qwen3-Thinking-2507
    "qwen3_moe": "qwen3",
    "qwen3_next": "qwen3",  # Qwen3-Next-*-Thinking
    "deepseek_v3": "deepseek_r1",  # DeepSeek-R1 (-0528): the template opens `<think>`
    "glm4_moe": "glm45",  # GLM-4.5 / 4.6
    "kimi_k2": "kimi_k2",  # Kimi-K2-Thinking
    "gpt_oss": "openai_gptoss",  # harmony's analysis channel
}
# families whose every checkpoint thinks (no template check)
ALWAYS_THINKS = frozenset({"gpt_oss"})
# a template that takes a `thinking` switch (DeepSeek-V3.1 and later): vLLM's deepseek_v3
# parser follows the switch (`chat_template_kwargs: {"thinking": true}`), off by default
THINKING_SWITCH = {"deepseek_v3": "deepseek_v3"}
# `architectures`, for a config.json without `model_type`
REASONING_PARSER_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "GptOssForCausalLM": "gpt_oss",
}
# `--reasoning-parser`'s default where the flag is not given (compose, Kubernetes: the engine's
# command is shared with the built-in worker, which takes no such flag); empty: none
ENV = "CTXCACHE_REASONING_PARSER"
PRESET_FILE = "ctxcache_preset.json"  # (worker.model_kind.KIND_FILE, without its imports)
THINK = "<think>"
_SWITCH = re.compile(r"\bthinking\b")


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def chat_template(model: str) -> str:
    """The model directory's chat template text ('' when it has none): `chat_template.jinja`
    (how transformers saves it now), else tokenizer_config.json's `chat_template` (a string,
    or a list of named templates, all of which are read)."""
    jinja = Path(model) / "chat_template.jinja"
    try:
        return jinja.read_text()
    except OSError:
        pass
    found = (_json(Path(model) / "tokenizer_config.json") or {}).get("chat_template")
    if isinstance(found, list):
        return "\n".join(str(t.get("template", "")) for t in found if isinstance(t, dict))
    return found if isinstance(found, str) else ""


def preset_record(model: str) -> dict | None:
    """The row `ctxcache model create` wrote into the directory, or None for other models."""
    return _json(Path(model) / PRESET_FILE)


def default_reasoning_parser(model: str) -> str | None:
    """vLLM's reasoning parser for the model directory `model`: a preset's recorded one (none
    for a preset that does not think), else the family's where the checkpoint thinks; None,
    logged, for anything else (a hub id: no local directory to read)."""
    record = preset_record(model)
    if record is not None:
        parser = record.get("reasoning_parser")
        return str(parser) if parser else None
    config = _json(Path(model) / "config.json")
    if config is None:
        log.info(
            "reasoning parser off: no config.json in %s to pick one from; pass "
            "--reasoning-parser NAME for a thinking model (docs/vllm.md, 'Reasoning models')",
            model,
        )
        return None
    family = config.get("model_type")
    if family not in REASONING_PARSERS:
        archs = config.get("architectures") or []
        known = [a for a in archs if a in REASONING_PARSER_ARCHITECTURES]
        family = REASONING_PARSER_ARCHITECTURES[known[0]] if known else family
    parser = REASONING_PARSERS.get(str(family))
    if parser is None or family in ALWAYS_THINKS:
        return parser
    template = chat_template(model)
    if THINK not in template:
        log.info(
            "reasoning parser off: model type %r, but its chat template writes no %s (a "
            "checkpoint that does not think); pass --reasoning-parser NAME if it does",
            family,
            THINK,
        )
        return None
    if family in THINKING_SWITCH and _SWITCH.search(template):
        return THINKING_SWITCH[str(family)]
    return parser


def reasoning_parser_choice(choice: str, model: str) -> str | None:
    """`--reasoning-parser`'s value: `auto` (the model's default), `none`, or a name."""
    if choice == "auto":
        return default_reasoning_parser(model)
    return None if choice in ("none", "") else choice


def preset_logits_processors(model: str) -> list[str]:
    """The logits processors (vLLM's `module:Class`) a preset's record asks for: the thinking
    preset's script that makes random weights close their thinking (worker/presets/
    think_script.py). A real model needs none; a model that is no preset gets none."""
    found = (preset_record(model) or {}).get("logits_processors") or []
    return [str(name) for name in found] if isinstance(found, list) else []


def add_reasoning_parser_argument(p: argparse.ArgumentParser) -> None:
    """`--reasoning-parser`, shared by `ctxcache vllm` and `ctxcache serve`."""
    p.add_argument(
        "--reasoning-parser",
        default=os.environ.get(ENV, "auto"),
        metavar="NAME|auto|none",
        help="vLLM's reasoning parser: the model's thinking in its own field, out of `content` "
        f"(default: ${ENV} if set, empty meaning none, else auto: by the model's family where "
        "the checkpoint thinks, e.g. qwen3 for Qwen3, openai_gptoss for gpt-oss; none for a "
        "model that does not; docs/vllm.md)",
    )
