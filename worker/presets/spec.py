"""The presets: one row per `ctxcache model create --preset NAME`, and the kinds they build.

A kind is an architecture and its KV layout: `dense` (Qwen2, full attention in every layer,
the only kind the built-in worker runs), `sliding` (Llama with per-layer `layer_types`,
windowed layers beside full ones), `mla` (DeepSeek-V3's latent attention, dense MLPs), `hybrid`
(Qwen3-Next: gated-delta-net linear attention beside full attention). Each kind's config is
written by the module of that name in this package.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("dense", "sliding", "mla", "hybrid")


@dataclass(frozen=True)
class Preset:
    vocab_size: int
    corpus_chars: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_model_len: int
    seed: int
    kind: str = "dense"
    # sliding: the window of the `sliding_attention` layers, in tokens
    sliding_window: int | None = None


TINY = Preset(
    vocab_size=4096,
    corpus_chars=3_000_000,
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=256,
    max_model_len=4096,
    seed=1234,
)
SMALL = Preset(
    vocab_size=8192,
    corpus_chars=6_000_000,
    hidden_size=768,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    intermediate_size=2048,
    max_model_len=8192,
    seed=5678,
)


def _kind(base: Preset, kind: str, seed: int, **changes: int) -> Preset:
    fields = {**base.__dict__, "kind": kind, "seed": seed, **changes}
    return Preset(**fields)


PRESETS: dict[str, Preset] = {
    # loads in well under a second; for tests
    "tiny": TINY,
    # ~88M parameters: a 1,000-token prefill takes about a second on 2 CPU cores
    "small": SMALL,
    # tiny's shape; layers alternate sliding (256 tokens, two of vLLM's CPU blocks) and full
    "tiny-sliding": _kind(TINY, "sliding", 2345, sliding_window=256),
    # small's shape; windowed layers of 512 tokens, every other layer
    "small-sliding": _kind(SMALL, "sliding", 6789, sliding_window=512),
    # tiny's shape with DeepSeek-V3's latent attention (512 + 64 per token and layer)
    "tiny-mla": _kind(TINY, "mla", 3456),
}
