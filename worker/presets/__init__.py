"""`ctxcache model create --preset NAME DIR`: deterministic random-weight models.

Seeded random weights and a real byte-level BPE tokenizer, saved as a Hugging Face
directory that vLLM (and, for the `dense` kind, `AutoModelForCausalLM.from_pretrained`)
loads offline. The presets and their kinds are in `spec.py`; each kind's config in the
module of its name (`dense.py`: Qwen2, `sliding.py`: Llama with windowed layers, ...).
"""

from __future__ import annotations

from worker.presets.model import PRESETS, Preset, create_model

__all__ = ["PRESETS", "Preset", "create_model"]
