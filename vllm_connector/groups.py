"""Which of vLLM's KV cache groups the connector serves (`served_groups`), from the engine's
`KVCacheConfig` (docs/vllm.md, "Hybrid models").

With vLLM's hybrid KV cache manager on (the connector is `SupportsHMA`), a model whose
layers differ in their attention has one KV cache group per kind (and per page-sized share
of layers), each with its own block table:

- full attention (`FullAttentionSpec`): served, every block;
- sliding window (`SlidingWindowSpec`): served, the last window (`group_plan`);
- Mamba / linear-attention state (`MambaSpec` with vLLM's prefix caching on, its
  `mamba_cache_mode` "align"): served, one state per hit (`state_plan`), beside full
  attention (not beside a sliding window, not with speculative decoding's extra blocks);
- a group vLLM does not transfer (`enable_kv_transfer` false: replicas it rebuilds from
  another group after a load): left alone;
- anything else — chunked local attention, MLA's latent cache, cross-attention — is not
  served. A load sets a request's computed tokens for **every** group at once, so a group
  the connector cannot fill makes loads impossible for the whole model: it runs without
  the cache, and `served_groups` says why.
"""

from __future__ import annotations

import hashlib

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from vllm_connector.group_plan import Group

STATE_VERSION = 1  # of a state block's payload (`state_worker`): in its keys' tags


def served_groups(kv_cache_config: KVCacheConfig) -> list[Group] | str:
    """The groups the connector serves, or why it serves none of this model (in words)."""
    out: list[Group] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(group, "enable_kv_transfer", True):
            continue
        spec = group.kv_cache_spec
        layers = tuple(group.layer_names)
        kind = _kind(spec)
        if kind == "full":
            out.append(Group(index, layers, spec.block_size))
        elif kind == "sliding":
            assert isinstance(spec, SlidingWindowSpec)
            out.append(
                Group(
                    index, layers, spec.block_size, spec.sliding_window, spec.extra_retained_tokens
                )
            )
        elif isinstance(spec, MambaSpec):
            refused = _state_refused(index, spec)
            if refused is not None:
                return refused
            out.append(Group(index, layers, spec.block_size, state=state_tag(spec)))
        else:
            return (
                f"a model with {type(spec).__name__} layers (KV cache group {index}; the "
                "connector serves full-attention and sliding-window groups)"
            )
    if not out:
        return "a model with no KV cache group to transfer"
    kinds = {"state" if g.state else "sliding" if g.window else "full" for g in out}
    if "state" in kinds and kinds != {"state", "full"}:
        return (
            "a hybrid model with recurrent-state layers beside "
            + ("sliding-window layers" if "sliding" in kinds else "no full attention")
            + " (the connector serves recurrent state beside full attention only)"
        )
    sizes = sorted({g.block_size for g in out})
    if len(sizes) > 1:
        return f"a hybrid model whose KV cache groups differ in block size ({sizes} tokens)"
    return out


def _kind(spec: KVCacheSpec) -> str | None:
    specs = (
        list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    )
    # (exact types: their subclasses — MLA, sinks, circular buffers — lay out or evict
    # blocks otherwise)
    if all(type(s) is FullAttentionSpec for s in specs):
        return "full"  # (with the hybrid manager off, a window layer is one of these: its
        # blocks are all kept)
    if len(specs) == 1 and type(spec) is SlidingWindowSpec:
        return "sliding"
    return None


def state_tag(spec: MambaSpec) -> str:
    """The version and a digest of a state group's layout (its tensors' shapes and dtypes
    on this rank, the kind of layer): a key's tag, so no other layout is ever loaded."""
    layout = repr((spec.mamba_type, spec.shapes, [str(d) for d in spec.dtypes]))
    digest = hashlib.blake2b(layout.encode(), digest_size=4).hexdigest()
    return f"{STATE_VERSION}.{digest}"


def _state_refused(index: int, spec: MambaSpec) -> str | None:
    head = (
        "a hybrid model with state-space or linear-attention layers (KV cache group "
        f"{index}: MambaSpec, mamba_cache_mode {spec.mamba_cache_mode!r}"
    )
    if spec.mamba_cache_mode != "align":
        return (
            f"{head}; the connector restores their state at a hit's end, which needs "
            "vLLM's prefix caching on: mamba_cache_mode 'align')"
        )
    if spec.num_speculative_blocks:
        return (
            f"{head}, {spec.num_speculative_blocks} speculative state blocks; the connector "
            "does not serve recurrent state with speculative decoding)"
        )
    return None
