"""The presets: one row per `ctxcache model create --preset NAME`, and the kinds they build.

A preset's kind is what its KV cache is, as vLLM sees it (and as the connector must serve
it): `dense`, full attention in every layer (Qwen2; the only kind the built-in worker
runs); `sliding`, windowed layers beside full ones (Llama with per-layer `layer_types`, or
Gemma 3's 5:1 shape); `mla`, DeepSeek-V3's latent attention; `hybrid`, gated-delta-net linear
attention beside full attention (Qwen3-Next). Its `arch` names the module of this package
that writes its config: `dense.py` (qwen2), `sliding.py` (llama), `gemma3.py`, `mla.py`
(deepseek_v3), `hybrid.py` (qwen3_next), `qwen3.py` (the thinking presets). A thinking
preset (`think_tokens` > 0) is a dense Qwen3 with Qwen3's thinking template (`think.py`) and
a script that makes its random weights think that many tokens, then answer
(`think_script.py`: a logits processor that vLLM loads; the built-in worker has none).
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
    # the architecture, one config module of this package each (a kind may have several)
    arch: str = "qwen2"
    # sliding: the window of the `sliding_attention` layers, in tokens
    sliding_window: int | None = None
    # thinking: the tokens of the model's own between `<think>\n` and `\n</think>\n\n`
    # that the think script lets it write (0: not a thinking preset)
    think_tokens: int = 0


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


def _kind(base: Preset, kind: str, arch: str, seed: int, **changes: int) -> Preset:
    fields = {**base.__dict__, "kind": kind, "arch": arch, "seed": seed, **changes}
    return Preset(**fields)


PRESETS: dict[str, Preset] = {
    # loads in well under a second; for tests
    "tiny": TINY,
    # ~88M parameters: a 1,000-token prefill takes about a second on 2 CPU cores
    "small": SMALL,
    # tiny's shape; layers alternate sliding (256 tokens, two of vLLM's CPU blocks) and full
    "tiny-sliding": _kind(TINY, "sliding", "llama", 2345, sliding_window=256),
    # small's shape; windowed layers of 512 tokens, every other layer
    "small-sliding": _kind(SMALL, "sliding", "llama", 6789, sliding_window=512),
    # tiny's shape with DeepSeek-V3's latent attention (512 + 64 per token and layer)
    "tiny-mla": _kind(TINY, "mla", "deepseek_v3", 3456),
    # tiny's shape; layers alternate a gated delta net (linear attention) and full attention
    "tiny-hybrid": _kind(TINY, "hybrid", "qwen3_next", 4567),
    # Gemma 3's shape at tiny's width: 6 layers, five 512-token windows to one global layer
    "tiny-gemma3": _kind(TINY, "sliding", "gemma3", 5678, num_layers=6, sliding_window=512),
    # tiny's shape as Qwen3, with Qwen3's thinking template: 12 tokens of thinking, then the
    # answer (vLLM's `qwen3` reasoning parser)
    "tiny-think": _kind(TINY, "dense", "qwen3", 7890, think_tokens=12),
    # small's shape, the same way, 24 tokens of thinking
    "small-think": _kind(SMALL, "dense", "qwen3", 8901, think_tokens=24),
}
