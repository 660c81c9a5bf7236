"""The builder that writes a preset's config, weights and tokenizer to a directory."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from worker.model_kind import KIND_FILE
from worker.presets import dense, gemma3, hybrid, mla, qwen3, sliding, think
from worker.presets.experts import per_expert
from worker.presets.spec import PRESETS, Preset
from worker.presets.tokenizer import BOS, EOS, PAD, self_retokenizing_ids, train_tokenizer

log = logging.getLogger(__name__)

__all__ = ["PRESETS", "Preset", "create_model"]

ConfigFn = Callable[[Preset, int, int, int, int], PretrainedConfig]
InitFn = Callable[[str, torch.Size, torch.Generator], torch.Tensor | None]
# each architecture's config, and where it has one, its initial values for some weights
CONFIGS: dict[str, ConfigFn] = {
    "qwen2": dense.config,
    "llama": sliding.config,
    "gemma3": gemma3.config,
    "deepseek_v3": mla.config,
    "qwen3_next": hybrid.config,
    "qwen3": qwen3.config,
}
INITS: dict[str, InitFn] = {"qwen3_next": hybrid.init, "gemma3": gemma3.init}
# the weights renamed as the architecture's checkpoints name them, where transformers' differ
CHECKPOINTS: dict[str, Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]] = {
    "qwen3_next": per_expert
}


@lru_cache(maxsize=4)
def _tokenizer(vocab_size: int, corpus_chars: int) -> tuple[PreTrainedTokenizerFast, list[int]]:
    """Trained once per process for each size (presets of one size share it)."""
    tokenizer = train_tokenizer(vocab_size, corpus_chars)
    return tokenizer, self_retokenizing_ids(tokenizer)


def _init(name: str, shape: torch.Size, gen: torch.Generator, arch: str) -> torch.Tensor:
    if (own := INITS.get(arch)) is not None and (t := own(name, shape, gen)) is not None:
        return t
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.randn(shape, generator=gen) * 0.02
    return torch.randn(shape, generator=gen) * 0.05


def _weights(config: PretrainedConfig, p: Preset, allowed: list[int]) -> dict[str, torch.Tensor]:
    """Seeded normal weights, in sorted-name order, so the same preset gives the same bytes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {
            n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()
        }
    gen = torch.Generator().manual_seed(p.seed)
    out = {name: _init(name, shapes[name], gen, p.arch).contiguous() for name in sorted(shapes)}
    if (checkpoint := CHECKPOINTS.get(p.arch)) is not None:
        out = checkpoint(out)
    # The output layer only produces ids whose text re-tokenizes to themselves (SPEC.md).
    mask = torch.zeros(config.vocab_size, dtype=torch.bool)
    mask[allowed] = True
    out["lm_head.weight"][~mask] = 0.0
    return out


def create_model(preset: str, out_dir: Path) -> Path:
    """Build `preset` into `out_dir` (created if needed); returns the directory."""
    p = PRESETS[preset]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, allowed = _tokenizer(p.vocab_size, p.corpus_chars)
    if p.think_tokens:  # `<think>`, `</think>` appended: the allowed ids stay as they are
        tokenizer = think.thinking_tokenizer(tokenizer)
    ids = [int(tokenizer.convert_tokens_to_ids(t)) for t in (BOS, EOS, PAD)]
    config = CONFIGS[p.arch](p, len(tokenizer), *ids)
    save_file(
        _weights(config, p, allowed),
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": ids[0], "eos_token_id": ids[1], "pad_token_id": ids[2]}, indent=2
        )
        + "\n"
    )
    row: dict[str, object] = {"preset": preset, **asdict(p), "output_token_ids": len(allowed)}
    if p.think_tokens:  # what `ctxcache vllm` starts it with, and its script's token ids
        row["reasoning_parser"] = think.REASONING_PARSER
        row["logits_processors"] = [think.SCRIPT]
        row["think"] = think.script_record(tokenizer, p.think_tokens)
    (out_dir / KIND_FILE).write_text(json.dumps(row, indent=2) + "\n")
    log.info(
        "model preset %s (%s, %s) written to %s (%d output tokens allowed of %d)",
        preset,
        p.kind,
        config.architectures[0] if config.architectures else config.model_type,
        out_dir,
        len(allowed),
        len(tokenizer),
    )
    return out_dir
