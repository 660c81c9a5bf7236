"""MLA models (DeepSeek-V2/V3, Kimi K2) through the connector: their latent KV cache.

An MLA layer caches no K and V per head but one latent vector per token: `kv_lora_rank`
channels of the compressed KV (`kv_c_normed`) and `qk_rope_head_dim` of the rotary key
(`k_pe`), in one tensor per layer, `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`
(vLLM's `MLAAttentionSpec`: one "KV head", no V; the CPU build's `CPU_MLA` backend writes it
with `do_kv_cache_update(kv_c_normed, k_pe, cache, slot_mapping, ...)`). What differs from
full attention, and lives here:
- **Layout.** One plane, not two: the connector's tensors are `[1, L, 1, T, latent]` and the
  layout probe learns where each `(token, channel)` of a block lands by writing with the
  layer's own MLA write (`probe_latent_layout`), as `layout.probe_layout` does for K and V.
  The copies (`layout`, `blockcopy`, the shm and tcp paths) then move it unchanged.
- **Payload.** LMCache's `KV_MLA_FMT`, `[1, num_layers, tokens, latent]` on the lm:// wire
  (format 6), in the cache dtype; through shared memory, the engine's own blocks, as for
  full attention. The keys carry the format's version (`VERSION_TAG`, `mla%1`), so an
  engine that writes another latent layout misses rather than reads these bytes.
- **Tensor parallelism.** vLLM replicates the latent on every tensor-parallel rank, so it is
  stored once: keys name no rank (`world_size` 1, `worker_id` 0, as LMCache does for MLA with
  `save_only_first_rank`), rank 0 stores, and every rank loads the same blocks
  (`WorkerSide(..., latent=True)`). Engines of any TP size share them.

What is refused (`unsupported`): a quantised latent (`--kv-cache-dtype fp8*`, `fp8_ds_mla`),
sparse MLA (DeepSeek-V3.2/V4: an indexer cache beside the latent), and anything that is not
one group of plain MLA layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_connector.layout import BlockLayout, LayoutError, probe_layout
from worker.kv.hashing import KeyMaker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

FORMAT_VERSION = 1
"""The latent payload's version: `[1, L, T, kv_lora_rank + qk_rope_head_dim]`, the compressed
KV's channels first, then the rotary key's, in the cache dtype."""
VERSION_TAG = ("mla", str(FORMAT_VERSION))

LatentWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""`(latent [T, kv_lora_rank + rope], kv_cache, slot_mapping [T])`: the layer's MLA write."""

# model types whose MLA is sparse: an indexer's cache beside the latent (vLLM's DeepSeek-V3.2
# and V4 backends), which these blocks do not hold
_SPARSE = ("deepseek_v32", "deepseek_v4")


def is_mla(vllm_config: VllmConfig) -> bool:
    model = vllm_config.model_config
    return model is not None and bool(getattr(model, "use_mla", False))


def unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    """What of this MLA engine the connector cannot serve, in words, or None."""
    from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec, UniformTypeKVCacheSpecs

    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        return f"an MLA model with a {cache_dtype} latent cache (--kv-cache-dtype; only 'auto')"
    hf = getattr(vllm_config.model_config, "hf_config", None)
    kind = getattr(hf, "model_type", None)
    if kind in _SPARSE or getattr(hf, "index_topk", None):
        return f"a sparse-MLA model ({kind}: an indexer cache beside the latent)"
    if kv_cache_config is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"an MLA model with {len(groups)} KV cache groups"
    spec = groups[0].kv_cache_spec
    specs = (
        list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    )
    for one in specs:
        if type(one) is not MLAAttentionSpec:
            return f"an MLA model with {type(one).__name__} layers (not plain MLA)"
        if one.kv_quant_mode != KVQuantMode.NONE or one.cache_dtype_str not in (None, "auto"):
            return f"an MLA model with a quantised latent ({one.cache_dtype_str})"
    return None


def key_maker(model: str, dtype: str) -> KeyMaker:
    """Keys of the latent's blocks: the same on every tensor-parallel rank and TP size
    (`world_size` 1, `worker_id` 0), with the format's version among their tags."""
    return KeyMaker(model, dtype, 0, 1, tags=(VERSION_TAG,))


def latent_writer(layer: Any) -> LatentWriter:
    """An MLA layer's own cache write (what its forward pass does), taking the whole latent."""
    impl = layer.impl
    if not hasattr(impl, "do_kv_cache_update"):
        raise TypeError(f"{type(impl).__name__} has no do_kv_cache_update")
    rank = int(layer.kv_lora_rank)
    cache_dtype = str(getattr(layer, "kv_cache_dtype", "auto"))
    scale = torch.ones((), dtype=torch.float32)  # (unused: only an unquantised latent)

    def write(latent: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        kv_c, k_pe = latent[:, :rank], latent[:, rank:].unsqueeze(1)  # k_pe: [T, 1, rope]
        impl.do_kv_cache_update(kv_c, k_pe, cache, slots, cache_dtype, scale.to(cache.device))

    return write


def probe_latent_layout(
    cache: torch.Tensor, write: LatentWriter, heads: int, latent: int
) -> BlockLayout:
    """Learn an MLA cache's block layout (`cache`: `[blocks, N, latent]`, or vLLM's per-layer
    view `[blocks, 1, N, latent]` as the CPU model runner registers it; any dense block)
    from its own write: `offsets` `[1, N, 1, latent]`.

    It runs `layout.probe_layout` on the cache seen as `[blocks, 1, N, latent]`, whose K and
    V are the latent's two halves (the probe's writes become one latent write each, into a
    scratch block shaped as the cache is), then joins the halves back into one plane."""
    four = cache.unsqueeze(1) if cache.dim() == 3 else cache
    if heads != 1 or four.dim() != 4 or four.shape[1] != 1 or four.shape[3] != latent or latent % 2:
        raise LayoutError(
            f"expected an MLA cache [blocks, tokens, {latent}] of one even latent, "
            f"got {tuple(cache.shape)} with {heads} heads"
        )
    half = latent // 2

    def halves(k: torch.Tensor, v: torch.Tensor, scratch: torch.Tensor, s: torch.Tensor) -> None:
        block = scratch.squeeze(1) if cache.dim() == 3 else scratch
        write(torch.cat([k, v], dim=-1).squeeze(1), block, s)

    two = probe_layout(four, halves, 1, half)  # offsets [2, N, 1, latent / 2]
    offsets = two.offsets.permute(1, 2, 0, 3).reshape(1, two.tokens, 1, latent)
    return BlockLayout(
        tokens=two.tokens,
        heads=1,
        head_dim=latent,
        elems=two.elems,
        block_stride=two.block_stride,
        offsets=offsets.contiguous(),
    )


def writers(layers: dict[str, Any], names: list[str]) -> dict[str, tuple[LatentWriter, int, int]]:
    """`WorkerSide.register`'s writers for an MLA model's layers: `(write, 1, latent)`."""
    return {name: (latent_writer(layers[name]), 1, int(layers[name].head_size)) for name in names}
