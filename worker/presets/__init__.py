"""`ctxcache model create --preset tiny|small DIR`: deterministic random-weight models.

A Qwen2 architecture (grouped-query attention, RoPE, RMSNorm, SwiGLU) with seeded random
weights and a real byte-level BPE tokenizer, saved as a Hugging Face directory that
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` load offline.
"""

from __future__ import annotations

from worker.presets.model import PRESETS, Preset, create_model

__all__ = ["PRESETS", "Preset", "create_model"]
