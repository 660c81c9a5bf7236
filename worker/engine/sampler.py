"""Greedy (temperature 0) and seeded temperature / top-k / top-p sampling of one token."""

from __future__ import annotations

import torch

from worker.engine.request import SamplingParams


def make_generator(params: SamplingParams, index: int) -> torch.Generator | None:
    """Choice `index` of a seeded request draws from `seed + index`; unseeded ones from a
    fresh random seed; greedy needs none."""
    if params.temperature == 0:
        return None
    gen = torch.Generator()
    if params.seed is not None:
        gen.manual_seed(params.seed + index)
    else:
        gen.seed()
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from `[vocab]` float32 logits (masked entries are -inf)."""
    if params.temperature == 0 or gen is None:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = cum - sorted_probs > params.top_p  # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen))
