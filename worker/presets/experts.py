"""Mixture-of-experts weights as checkpoints store them."""

from __future__ import annotations

import torch


def per_expert(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Experts as checkpoints store them, one 2-D weight per expert and projection.

    transformers holds a layer's experts fused (`experts.gate_up_proj` `[E, 2I, H]`,
    `experts.down_proj` `[E, H, I]`) and converts the per-expert names when it loads;
    vLLM's loaders read the per-expert names (`experts.{e}.gate_proj.weight`, ...)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            gates, ups = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gates[e].contiguous()
                out[f"{base}{e}.up_proj.weight"] = ups[e].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e, down in enumerate(t):
                out[f"{base}{e}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = t
    return out
