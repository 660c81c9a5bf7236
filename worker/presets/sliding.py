"""`sliding`: windowed layers beside full-attention ones, as Mistral, gpt-oss and Gemma mix them.

A Llama architecture (the Qwen2 shape without q/k/v biases) whose `layer_types` alternate
`sliding_attention` and `full_attention`, starting with a windowed layer. vLLM 0.32 reads
`layer_types` per layer for Llama (`LlamaAttention` passes `per_layer_sliding_window`); its
Qwen2 and Qwen3 models do not (`Qwen2Model` asserts that all layers or none are windowed),
so a Qwen-style mix has to be Llama here. With the hybrid KV-cache manager on, vLLM builds
two KV-cache groups from it: `FullAttentionSpec` and `SlidingWindowSpec`.
"""

from __future__ import annotations

from transformers import LlamaConfig

from worker.presets.spec import Preset


def layer_types(num_layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def config(p: Preset, vocab_size: int, bos: int, eos: int, pad: int) -> LlamaConfig:
    assert p.sliding_window is not None
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.hidden_size // p.num_heads,
        max_position_embeddings=p.max_model_len,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        layer_types=layer_types(p.num_layers),
        sliding_window=p.sliding_window,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )
