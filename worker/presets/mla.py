"""`mla`: DeepSeek-V3's multi-head latent attention, with dense MLPs in every layer.

Each layer caches one latent per token, `kv_lora_rank + qk_rope_head_dim` values (no heads),
instead of keys and values per head. The latent's sizes are DeepSeek-V3's own (512 + 64):
vLLM's CPU MLA backend (`v1/attention/backends/mla/cpu_mla.py`) supports only that head size
(576) and runs on 16-token blocks; the rest of the model is `tiny`'s. `first_k_dense_replace`
equal to the layer count makes every MLP dense (no experts, no router).
"""

from __future__ import annotations

from transformers import DeepseekV3Config

from worker.presets.spec import Preset

KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 32
V_HEAD_DIM = 32


def config(p: Preset, vocab_size: int, bos: int, eos: int, pad: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        moe_intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_heads,
        first_k_dense_replace=p.num_layers,
        # no layer reaches first_k_dense_replace: these describe experts no layer has
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
        kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=None,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        max_position_embeddings=p.max_model_len,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )
