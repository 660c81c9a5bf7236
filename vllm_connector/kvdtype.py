"""The KV cache's own dtype, as the connector stores it: the model's (`--kv-cache-dtype
auto`) or fp8 (`fp8` = `fp8_e4m3`, `fp8_e5m2`), with vLLM's per-tensor scales.

vLLM keeps an fp8 cache as `torch.uint8` and quantises on write: its CPU backend's
`cpu_attn_reshape_and_cache` stores `x / k_scale` (`v_scale`) as fp8, rounded toward zero;
attention multiplies back. The connector moves those bytes as they are, so an fp8 cache
costs half of bf16 per token in every tier, and a load writes back exactly what the
engine's own prefill wrote. To the connector's copies the cache is a float8 view of vLLM's
bytes (`cache_views`): the block layout probe, the payload's dtype (`KV_2LTD` dtype 7 or 8,
LMCache's `protocol.DTYPE_TO_INT`) and the key's dtype field (`fp8_e4m3fn`, `fp8_e5m2`,
LMCache's `utils.TORCH_DTYPE_TO_STR_DTYPE` names for those dtypes) all follow it. So an
engine restarted with another KV dtype looks up other keys and recomputes, and a payload
of another dtype is refused on load (`KVShape.from_wire`, `shm_loads`) as a second guard.

The scales: vLLM 0.32 computes none at run time for a per-tensor fp8 cache; they are 1.0
unless the checkpoint carries `k_scale`/`v_scale` (loaded with its weights, like them
named by the key's model field). The worker logs them at start-up (`describe_scales`).
Per-token-head and other quantised caches (`fp8_per_token_head`, `int8_per_token_head`,
nvfp4, turboquant, ...) carry scales inside the cache and stay refused, as does a cache
whose layers differ in dtype (`--kv-cache-dtype-skip-layers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_connector.layout import CacheWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM's --kv-cache-dtype values we serve -> the float8 dtype its uint8 bytes hold
FP8_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The probe's values are nudged up by this much before the write divides by the scale:
# the CPU write rounds toward zero, and `digit * scale / scale` may land a hair below.
_PROBE_NUDGE = 1 + 1 / 64


def kv_dtype(vllm_config: VllmConfig) -> torch.dtype:
    """The dtype the connector stores: the fp8 format of the cache, else the model's."""
    cache_dtype = vllm_config.cache_config.cache_dtype or "auto"
    return FP8_CACHE_DTYPES.get(cache_dtype, vllm_config.model_config.dtype)


def _fnuz() -> bool:
    """Whether this platform's fp8 e4m3 is fnuz (ROCm MI300), which LMCache's payload
    header has no code for."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_fp8_fnuz())


def unsupported_cache_dtype(vllm_config: VllmConfig) -> str | None:
    """Why the connector cannot serve this `--kv-cache-dtype`, or None ('auto', fp8)."""
    cache = vllm_config.cache_config
    cache_dtype = cache.cache_dtype
    if cache_dtype in ("auto", None):
        return None
    if cache_dtype not in FP8_CACHE_DTYPES:
        served = ", ".join(["auto", *FP8_CACHE_DTYPES])
        return f"a {cache_dtype} KV cache (--kv-cache-dtype {cache_dtype}; served: {served})"
    if FP8_CACHE_DTYPES[cache_dtype] is torch.float8_e4m3fn and _fnuz():
        return f"a {cache_dtype} KV cache in fp8 e4m3fnuz (this platform's e4m3)"
    if getattr(cache, "kv_cache_dtype_skip_layers", None):
        return (
            f"a KV cache of mixed dtypes ({cache_dtype} but "
            f"--kv-cache-dtype-skip-layers {','.join(cache.kv_cache_dtype_skip_layers)})"
        )
    return None


def cache_views(kv_caches: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """vLLM's caches as the connector reads them: an fp8 cache's uint8 bytes as `dtype`
    (the same storage), any other cache as it is."""
    if dtype.itemsize != 1 or not dtype.is_floating_point:
        return kv_caches
    out = {}
    for name, cache in kv_caches.items():
        if cache.dtype not in (torch.uint8, dtype):
            raise ValueError(f"layer {name}: a {cache.dtype} cache in an fp8 KV cache")
        out[name] = cache.view(dtype)
    return out


def layer_scales(layer: Any) -> tuple[float, float]:
    """An attention layer's per-tensor (k_scale, v_scale), as its cache write uses them."""
    return float(getattr(layer, "_k_scale_float", 1.0)), float(
        getattr(layer, "_v_scale_float", 1.0)
    )


def probe_writer(
    write: CacheWriter, source: torch.dtype, scales: tuple[float, float] = (1.0, 1.0)
) -> CacheWriter:
    """`write` (the backend's cache write into vLLM's uint8 cache, quantising K and V of
    the model's dtype `source` with `scales`) as `probe_layout` calls it: with values of
    the cache's fp8 dtype and a float8 view of the cache. A probe digit `d` reaches the
    cache as `d` exactly: written as `d * scale` (nudged up: the write rounds toward zero),
    stored as `d` (`layout._digit_base` keeps digits where fp8 holds integers exactly)."""
    k_scale, v_scale = scales

    def scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x.to(torch.float32) * (scale * _PROBE_NUDGE)).to(source).contiguous()

    def fp8_write(
        key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        write(scaled(key, k_scale), scaled(value, v_scale), cache.view(torch.uint8), slots)

    return fp8_write


def wrap_writer(
    dtype: torch.dtype, source: torch.dtype
) -> Callable[[CacheWriter, Any], CacheWriter]:
    """For `register_kv_caches`: each layer's writer as the probe calls it (fp8: through
    `probe_writer` with the layer's scales; else as it is)."""
    if dtype.itemsize != 1:
        return lambda write, layer: write
    return lambda write, layer: probe_writer(write, source, layer_scales(layer))


def describe_scales(layers: list[Any]) -> str:
    """The layers' k/v scales in words, for the start-up line."""
    pairs = {layer_scales(layer) for layer in layers}
    if pairs <= {(1.0, 1.0)}:
        return "scales 1.0"
    ks = [k for k, _ in pairs]
    vs = [v for _, v in pairs]
    return (
        f"the checkpoint's per-tensor scales (k {min(ks):g}..{max(ks):g}, "
        f"v {min(vs):g}..{max(vs):g})"
    )
