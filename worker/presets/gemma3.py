"""Gemma 3's shape, of the `sliding` kind: five windowed layers to one global one.

A `Gemma3ForCausalLM` text model (no vision tower): `layer_types` repeat five
`sliding_attention` layers and one `full_attention` layer, the local layers with their own
RoPE base (10,000 against the global layers' 1,000,000), q/k norms, and the four RMSNorms
per layer that Gemma puts around attention and MLP. Gemma's RMSNorms scale by
`1 + weight`, so their weights are zero; the output layer is untied from the embeddings
(Gemma ties them), so that its rows can be zeroed without zeroing input embeddings. vLLM
builds a `SlidingWindowSpec` group and a `FullAttentionSpec` group from it, as from
`sliding.py`, but in a 5:1 proportion.
"""

from __future__ import annotations

import torch
from transformers import Gemma3TextConfig

from worker.presets.spec import Preset

PATTERN = 6  # one full-attention layer in six


def layer_types(num_layers: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def config(p: Preset, vocab_size: int, bos: int, eos: int, pad: int) -> Gemma3TextConfig:
    assert p.sliding_window is not None
    head_dim = p.hidden_size // p.num_heads
    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=p.sliding_window,
        layer_types=layer_types(p.num_layers),
        max_position_embeddings=p.max_model_len,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )


def init(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor | None:
    if name.endswith("norm.weight"):
        return torch.zeros(shape)  # `(1 + weight) * x`: unit scale
    return None
