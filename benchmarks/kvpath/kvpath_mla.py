"""An MLA model's latent cache for `ctxcache bench kvpath` (kvpath.py): vLLM's layout,
`[blocks, N, kv_lora_rank + qk_rope_head_dim]`, written by vLLM's own CPU MLA write
(`CPUMLAImpl.do_kv_cache_update`) where vLLM is installed, else by the same write in plain
torch (on CUDA too: the CUDA MLA backends' cache is this shape). The connector learns its
layout from that write (`vllm_connector.mla.probe_latent_layout`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

KV_LORA_RANK = 512  # DeepSeek-V2/V3 and Kimi K2: 512 + 64 = 576 channels a token and layer


def latent_cache_and_writer(
    blocks: int, n: int, latent: int, dtype: Any, device: Any
) -> tuple[Any, Callable[..., None], str]:
    """The cache tensor, its latent write `(latent [T, C], cache, slots)`, and its name."""
    import torch

    from vllm_connector.mla import latent_writer

    cache = torch.empty(blocks, n, latent, dtype=dtype, device=device)
    impl = vllm_cpu_mla_impl(latent) if device.type == "cpu" else None
    name = "vLLM CPU MLA latent"
    if impl is None:
        impl, name = SimpleNamespace(do_kv_cache_update=_torch_write), "MLA latent (torch write)"
    layer = SimpleNamespace(impl=impl, kv_lora_rank=KV_LORA_RANK, kv_cache_dtype="auto")
    return cache, latent_writer(layer), name


def vllm_cpu_mla_impl(latent: int) -> Any:
    """vLLM's CPU MLA impl for a latent of `latent` channels (its real cache write), or None
    where vLLM is not installed."""
    try:
        with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations)
            warnings.simplefilter("ignore", DeprecationWarning)
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl
    except Exception:
        return None
    return CPUMLAImpl(
        num_heads=1,
        head_size=latent,
        scale=1.0,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK,
        qk_nope_head_dim=128,
        qk_rope_head_dim=latent - KV_LORA_RANK,
        qk_head_dim=128 + latent - KV_LORA_RANK,
        v_head_dim=128,
        kv_b_proj=None,
    )


def _torch_write(
    kv_c: Any, k_pe: Any, cache: Any, slots: Any, cache_dtype: str, scale: Any
) -> None:
    flat = cache.view(-1, cache.shape[-1])
    flat[slots, : kv_c.shape[-1]] = kv_c.to(cache.dtype)
    flat[slots, kv_c.shape[-1] :] = k_pe.squeeze(1).to(cache.dtype)
