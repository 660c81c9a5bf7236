"""`dense`: Qwen2, grouped-query full attention in every layer (`tiny`, `small`)."""

from __future__ import annotations

from transformers import Qwen2Config

from worker.presets.spec import Preset


def config(p: Preset, vocab_size: int, bos: int, eos: int, pad: int) -> Qwen2Config:
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
