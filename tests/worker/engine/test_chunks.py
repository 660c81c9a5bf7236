"""Chunk boundaries and positions after a cached prefix."""

from __future__ import annotations

import pytest
import torch

from tests.worker.conftest import (
    CHUNK,
    EngineFactory,
    Sidecar,
    assert_matches_recompute,
    generate,
    random_ids,
)
from worker.engine.runner import ModelRunner


@pytest.mark.parametrize("tail_blocks", [True, False])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_prompt_of_k_chunks_plus_minus_one(
    make_engine: EngineFactory,
    runner: ModelRunner,
    sidecar: Sidecar,
    k: int,
    delta: int,
    tail_blocks: bool,
) -> None:
    """A context of k*chunk + delta tokens (prefilled only), then a follow-up turn, cold L1."""
    engine = make_engine(sidecar, tail_blocks=tail_blocks)
    rng = torch.Generator().manual_seed(100 * k + delta)
    m = k * CHUNK + delta
    context = random_ids(rng, m)
    generate(engine, context, max_tokens=0)  # stores the KV of exactly m tokens
    engine.kv.l1.clear()
    result = generate(engine, context + random_ids(rng, 9))
    full_chunks = m // CHUNK * CHUNK
    tail = (m - full_chunks) // 16 * 16 if tail_blocks else 0
    assert result.prefix.sidecar_tokens == full_chunks + tail
    assert_matches_recompute(runner, result)


@pytest.mark.parametrize("m", [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK])
def test_repeated_prompt_computes_its_last_token(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar, m: int
) -> None:
    """The same prompt again reuses at most len - 1 tokens: one is computed for the logits."""
    engine = make_engine(sidecar)
    ids = random_ids(torch.Generator().manual_seed(m), m)
    generate(engine, ids, max_tokens=0)
    hot = generate(engine, ids)
    assert hot.prefix.tokens == (m - 1 if m >= 16 else 0) if m % 16 == 0 else m // 16 * 16
    assert_matches_recompute(runner, hot)
    engine.kv.l1.clear()
    cold = generate(engine, ids)
    assert cold.prefix.tokens <= m - 1
    assert_matches_recompute(runner, cold)


@pytest.mark.parametrize("cached", [1, 15, 16, 33, 64, 99])
def test_positions_after_a_cached_prefix(runner: ModelRunner, cached: int) -> None:
    """Prefilling ids[P:] after the KV of ids[:P] puts them at positions P.. (RoPE)."""
    ids = random_ids(torch.Generator().manual_seed(cached), 100)
    _, cache = runner.prefill([*ids[:cached], 0], None)  # KV of ids[:cached] (+1 dropped)
    from worker.engine.runner import kv_of_row

    prefix = kv_of_row(cache, 0, 0, cached)
    logits, _ = runner.prefill(ids, prefix)
    ref = runner.full_logits(ids)[-1]
    live = torch.isfinite(ref)
    assert (logits[live] - ref[live]).abs().max().item() < 1e-4
    # the same tokens at the wrong positions give different logits: the check can fail
    shifted, _ = runner.prefill(ids[cached:], None)
    assert (shifted[live] - ref[live]).abs().max().item() > 1e-3
