"""`dense` as Qwen3 writes it (`tiny-think`, `small-think`): Qwen2's shape without q/k/v
biases, with an RMSNorm on each head's queries and keys.

The thinking presets are Qwen3 so that auto picks vLLM's `qwen3` reasoning parser by the
model's family, as for a real Qwen3 (ctxcache/vllm_reasoning.py); their preset record names
the parser as well.
"""

from __future__ import annotations

from transformers import Qwen3Config

from worker.presets.spec import Preset


def config(p: Preset, vocab_size: int, bos: int, eos: int, pad: int) -> Qwen3Config:
    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_kv_heads,
        head_dim=p.hidden_size // p.num_heads,
        max_position_embeddings=p.max_model_len,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # lm_head rows are zeroed, the embeddings are not
        use_sliding_window=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )
