"""Reused KV gives the logits of a full recompute (1e-4, float32) and the same greedy tokens.

Multi-turn conversations on the tiny model: each turn is the previous turn's prompt and
output plus new tokens, as the gateway builds it.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from tests.worker.conftest import (
    CHUNK,
    EngineFactory,
    Pending,
    Sidecar,
    assert_matches_recompute,
    generate,
    greedy,
    random_ids,
)
from worker.engine.runner import ModelRunner

TAGS = (("s", "session-a"),)


def conversation(
    engine, runner: ModelRunner, turns: list[int], *, cold_l1: bool = False, seed: int = 0
):
    """Run a conversation; every turn must match recompute. Returns the turn results."""
    rng = torch.Generator().manual_seed(seed)
    history: list[int] = []
    results = []
    for new in turns:
        if cold_l1:
            engine.kv.l1.clear()
        result = generate(engine, history + random_ids(rng, new), tags=TAGS)
        assert_matches_recompute(runner, result)
        history = result.prompt + result.tokens
        results.append(result)
    return results


def test_l1_hit_multi_turn(make_engine: EngineFactory, runner: ModelRunner) -> None:
    results = conversation(make_engine(), runner, [40, 25, 70, 9])
    assert results[0].prefix.tokens == 0
    for prev, turn in pairwise(results):
        kv_len = len(prev.prompt) + len(prev.tokens) - 1  # the last sampled token has no KV
        assert turn.prefix.l1_tokens == turn.prefix.tokens == kv_len // 16 * 16
        assert len(prev.prompt + prev.tokens) - turn.prefix.tokens <= 16


def test_sidecar_hit_with_cold_l1(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    results = conversation(make_engine(sidecar), runner, [50, 30, 90, 12], cold_l1=True)
    for prev, turn in pairwise(results):
        kv_len = len(prev.prompt) + len(prev.tokens) - 1
        assert turn.prefix.l1_tokens == 0
        # full chunks + the tail block at 16-token granularity
        assert turn.prefix.sidecar_tokens == kv_len // 16 * 16


def test_sidecar_full_chunks_only(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    engine = make_engine(sidecar, tail_blocks=False)
    results = conversation(engine, runner, [50, 30, 90], cold_l1=True, seed=3)
    for prev, turn in pairwise(results):
        kv_len = len(prev.prompt) + len(prev.tokens) - 1
        assert turn.prefix.sidecar_tokens == kv_len // CHUNK * CHUNK


def test_partial_prefix_l1_then_sidecar(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    """L1 holds the start (a budget too small for the rest), the sidecar the remainder."""
    engine = make_engine(sidecar)
    rng = torch.Generator().manual_seed(7)
    first = generate(engine, random_ids(rng, 150), tags=TAGS)
    engine.kv.l1.clear()
    # put only the first 48 tokens' blocks back into the L1
    generate(engine, first.prompt[:49], max_tokens=0, tags=TAGS)
    follow = first.prompt + first.tokens + random_ids(rng, 20)
    result = generate(engine, follow, tags=TAGS)
    assert result.prefix.l1_tokens == 48
    assert result.prefix.sidecar_tokens == (150 + 6 - 1) // 16 * 16 - 48
    assert_matches_recompute(runner, result)


def test_divergent_prefix_reuses_only_the_common_part(
    make_engine: EngineFactory, runner: ModelRunner
) -> None:
    engine = make_engine()
    rng = torch.Generator().manual_seed(11)
    base = random_ids(rng, 100)
    generate(engine, base)
    fork = base[:70] + random_ids(rng, 40)
    result = generate(engine, fork)
    assert result.prefix.tokens == 64  # blocks [0, 64) are shared; block [64, 80) is not
    assert_matches_recompute(runner, result)


def test_after_sidecar_restart(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    engine = make_engine(sidecar)
    rng = torch.Generator().manual_seed(5)
    first = generate(engine, random_ids(rng, 120), tags=TAGS)
    sidecar.stop()
    sidecar.start()  # the disk tier brings the blocks back
    engine.kv.sidecar.breaker.success()  # don't wait out a backoff from the restart
    engine.kv.l1.clear()
    result = generate(engine, first.prompt + first.tokens + random_ids(rng, 10), tags=TAGS)
    assert result.prefix.sidecar_tokens > 0
    assert_matches_recompute(runner, result)


def test_four_concurrent_requests_in_one_batch(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    engine = make_engine(sidecar)
    rng = torch.Generator().manual_seed(9)
    histories = [
        generate(engine, random_ids(rng, n), tags=(("s", f"c{n}"),)) for n in (33, 64, 90, 17)
    ]
    engine.kv.l1.clear()
    pending = [
        Pending(
            engine,
            h.prompt + h.tokens + random_ids(rng, 5 + 7 * i),
            greedy(12),
            (("s", f"c{len(h.prompt)}"),),
        )
        for i, h in enumerate(histories)
    ]
    results = [p.result() for p in pending]
    assert engine.peak_batch == 4
    for result in results:
        assert result.prefix.tokens > 0
        assert_matches_recompute(runner, result)
