"""The model on CPU: load it, prefill a sequence after a cached prefix, decode a batch.

KV is handed around as one tensor per sequence, `[2, L, H, T, D]`; the model sees it as a
transformers `DynamicCache` (per layer `[batch, H, T, D]`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import DynamicLayer

from worker.kv.layout import KVShape
from worker.model_kind import check_builtin

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def cache_from_kv(kv: torch.Tensor | None) -> DynamicCache:
    """A batch-1 DynamicCache over `kv` (`[2, L, H, T, D]`, not copied), or an empty one.

    The layers hold views of `kv`; the model's first update concatenates them with the new
    tokens (the one copy every prefill makes anyway).
    """
    cache = DynamicCache()
    if kv is None:
        return cache
    for i in range(kv.shape[1]):
        layer = DynamicLayer()
        keys, values = kv[0, i][None], kv[1, i][None]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def kv_of_row(cache: DynamicCache, row: int, start: int, end: int | None = None) -> torch.Tensor:
    """Row `row` of a batch cache, columns `[start:end]`, as an owned `[2, L, H, T, D]`."""
    keys = [layer.keys[row, :, start:end] for layer in cache.layers]
    values = [layer.values[row, :, start:end] for layer in cache.layers]
    return torch.stack([torch.stack(keys), torch.stack(values)])


class ModelRunner:
    def __init__(self, model: str, dtype: str = "float32", threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.dtype = DTYPES[dtype]
        check_builtin(model)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model)
        self.model: Any = AutoModelForCausalLM.from_pretrained(model, dtype=self.dtype).eval()
        cfg = self.model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_shape = KVShape(
            cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, self.dtype
        )
        self.max_model_len = int(cfg.max_position_embeddings)
        self.vocab_size = int(cfg.vocab_size)
        eos = self.model.generation_config.eos_token_id or cfg.eos_token_id
        self.eos_ids: set[int] = set(
            eos if isinstance(eos, list) else [eos] if eos is not None else []
        )
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(int(self.tokenizer.eos_token_id))
        # Output rows that are all zero never produce a token (the presets zero the rows of
        # ids whose text does not re-tokenize to themselves, SPEC.md); a real model has none.
        head = self.model.get_output_embeddings().weight
        dead = (head == 0).all(dim=1)
        self.logit_mask: torch.Tensor | None = dead if bool(dead.any()) else None
        log.info(
            "model %s loaded: %d layers, %d kv heads x %d, %s, max_model_len %d",
            model,
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            head_dim,
            dtype,
            self.max_model_len,
        )

    def _mask(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.logit_mask is not None:
            logits = logits.masked_fill(self.logit_mask, float("-inf"))
        return logits

    @torch.inference_mode()
    def prefill(
        self, ids: list[int], prefix: torch.Tensor | None
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Run `ids[P:]` after the cached `prefix` (KV of `ids[:P]`); last logits + cache."""
        cached = 0 if prefix is None else int(prefix.shape[3])
        cache = cache_from_kv(prefix)
        new = torch.tensor([ids[cached:]], dtype=torch.long)
        positions = torch.arange(cached, len(ids), dtype=torch.long)[None]
        out = self.model(
            input_ids=new,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return self._mask(out.logits[0, -1]), cache

    @torch.inference_mode()
    def decode(
        self,
        cache: DynamicCache,
        tokens: list[int],
        positions: list[int],
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """One step for a batch: `tokens[i]` at `positions[i]`; returns `[B, vocab]` logits."""
        out = self.model(
            input_ids=torch.tensor(tokens, dtype=torch.long)[:, None],
            position_ids=torch.tensor(positions, dtype=torch.long)[:, None],
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
        )
        return self._mask(out.logits[:, -1])

    @torch.inference_mode()
    def full_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position of `ids`, no cache (the reference for equivalence)."""
        out = self.model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
        return self._mask(out.logits[0])
