"""Preset sizes and the builder that writes config, weights and tokenizer to a directory."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen2Config

from worker.presets.tokenizer import BOS, EOS, PAD, self_retokenizing_ids, train_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    corpus_chars: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_model_len: int
    seed: int


PRESETS: dict[str, Preset] = {
    # loads in well under a second; for tests
    "tiny": Preset(
        vocab_size=4096,
        corpus_chars=3_000_000,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        max_model_len=4096,
        seed=1234,
    ),
    # ~88M parameters: a 1,000-token prefill takes about a second on 2 CPU cores
    "small": Preset(
        vocab_size=8192,
        corpus_chars=6_000_000,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        intermediate_size=2048,
        max_model_len=8192,
        seed=5678,
    ),
}


def _config(p: Preset, vocab_size: int, bos: int, eos: int, pad: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        max_position_embeddings=p.max_model_len,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # lm_head rows are zeroed, the embeddings are not
        use_sliding_window=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )


def _weights(config: Qwen2Config, seed: int, allowed: list[int]) -> dict[str, torch.Tensor]:
    """Seeded normal weights, in sorted-name order, so the same preset gives the same bytes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {
            n: p.shape for n, p in AutoModelForCausalLM.from_config(config).named_parameters()
        }
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.randn(shape, generator=gen) * 0.02
        else:
            t = torch.randn(shape, generator=gen) * 0.05
        out[name] = t.contiguous()
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
    tokenizer = train_tokenizer(p.vocab_size, p.corpus_chars)
    allowed = self_retokenizing_ids(tokenizer)
    ids = [int(tokenizer.convert_tokens_to_ids(t)) for t in (BOS, EOS, PAD)]
    config = _config(p, len(tokenizer), *ids)
    save_file(
        _weights(config, p.seed, allowed),
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
    (out_dir / "ctxcache_preset.json").write_text(
        json.dumps({"preset": preset, **asdict(p), "output_token_ids": len(allowed)}, indent=2)
        + "\n"
    )
    log.info(
        "model preset %s written to %s (%d output tokens allowed of %d)",
        preset,
        out_dir,
        len(allowed),
        len(tokenizer),
    )
    return out_dir
