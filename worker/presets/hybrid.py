"""`hybrid`: Qwen3-Next's gated delta net (linear attention) beside full-attention layers.

A `Qwen3NextForCausalLM` whose `layer_types` alternate `linear_attention` (a gated delta
net: a short causal convolution and a recurrent state per sequence, no KV per token) and
`full_attention` (gated attention, a quarter of each head rotated); each layer's MLP is a
small mixture of experts (4 experts, 2 per token, and a shared one): vLLM's Qwen3-Next
refuses a model without an expert layer ("No Qwen3Next layer found"). Qwen3.5 has the same
layers, but vLLM's `Qwen3_5ForCausalLM` imports its vision model, which needs torchvision
(not installed with ctxcache). vLLM gives the linear layers a `MambaSpec` state (conv + SSM
state) and the full ones KV blocks. Its CPU kernels for the delta net
(`ops/cpu/gdn_attention.py`) compute in bfloat16 only (they assert it), so this kind runs
with `--dtype bfloat16`. Qwen3-Next's RMSNorms scale by `1 + weight`, so their weights are
zero.
"""

from __future__ import annotations

import torch
from transformers import Qwen3NextConfig

from worker.presets.spec import Preset

# vLLM's CPU chunked delta rule (`chunk_gated_delta_rule_cpu`) takes Qwen3-Next's 128 only
# ("Unexpected head dim size, 32")
LINEAR_HEAD_DIM = 128
LINEAR_KEY_HEADS = 2
LINEAR_VALUE_HEADS = 4


def layer_types(num_layers: int) -> list[str]:
    return ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def config(p: Preset, vocab_size: int, bos: int, eos: int, pad: int) -> Qwen3NextConfig:
    return Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.hidden_size // p.num_heads,
        layer_types=layer_types(p.num_layers),
        linear_key_head_dim=LINEAR_HEAD_DIM,
        linear_value_head_dim=LINEAR_HEAD_DIM,
        linear_num_key_heads=LINEAR_KEY_HEADS,
        linear_num_value_heads=LINEAR_VALUE_HEADS,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=p.intermediate_size // 4,
        shared_expert_intermediate_size=p.intermediate_size // 4,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=p.max_model_len,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "partial_rotary_factor": 0.25,
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="bfloat16",
    )


def init(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor | None:
    """Qwen3.5's own values where a plain normal draw would be wrong; None: the default."""
    if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
        return torch.zeros(shape)  # `(1 + weight) * x`: unit scale
    if name.endswith(".A_log"):
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if name.endswith(".dt_bias"):
        return torch.ones(shape)
    return None
