"""Session tags: the same prompt under two tags shares nothing in the sidecar."""

from __future__ import annotations

import torch

from ctxcache.lmcache_keys import parse_key
from sidecar.client import KVClient
from tests.worker.conftest import (
    EngineFactory,
    Sidecar,
    assert_matches_recompute,
    generate,
    random_ids,
)
from worker.engine.runner import ModelRunner, kv_of_row
from worker.kv.hashing import KeyMaker
from worker.kv.l1 import L1Cache
from worker.kv.manager import KVManager


def test_tags_isolate_sessions_in_the_sidecar(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    engine = make_engine(sidecar)
    ids = random_ids(torch.Generator().manual_seed(12), 100)
    a = (("s", "alice"),)
    b = (("s", "bob"),)
    generate(engine, ids, tags=a)
    with KVClient.from_url(sidecar.lm_url) as client:
        keys_a = set(client.list_keys())
    engine.kv.l1.clear()
    as_b = generate(engine, [*ids, 7], tags=b)
    assert as_b.prefix.sidecar_tokens == 0  # alice's blocks are not bob's
    assert_matches_recompute(runner, as_b)
    with KVClient.from_url(sidecar.lm_url) as client:
        keys = set(client.list_keys())
    keys_b = keys - keys_a
    assert keys_a and keys_b
    assert {parse_key(k).session for k in keys_a} == {"alice"}
    assert {parse_key(k).session for k in keys_b} == {"bob"}
    # the same chunks, under both tags: equal hashes, different keys
    assert {parse_key(k).chunk_hash for k in keys_a} <= {parse_key(k).chunk_hash for k in keys_b}
    engine.kv.l1.clear()
    again_a = generate(engine, [*ids, 7], tags=a)
    assert again_a.prefix.sidecar_tokens == (100 + 6 - 1) // 16 * 16


def test_l1_tail_tokens_reuse_every_token_of_a_hot_sequence(runner: ModelRunner) -> None:
    """With `l1_tail_tokens` a finished sequence's last partial block is kept too: the next
    turn's prefix covers all of it, and the output matches a full recompute."""
    kv = KVManager(L1Cache(1 << 30), None, KeyMaker("tiny", "float32", 0), 64, l1_tail_tokens=True)
    ids = list(range(100, 137))  # 2 full blocks + 5 tokens
    _, cache = runner.prefill(ids, None)
    full = kv_of_row(cache, 0, 0)
    kv.store(ids, full, (), kv.lookup(ids, ()), "-")
    turn = [*ids, 7, 8, 9]
    prefix = kv.lookup(turn, ())
    assert prefix.tokens == prefix.l1_tokens == len(ids)
    assert torch.equal(prefix.kv, full)
    assert kv.lookup([*ids[:35], 1, 2, 3], ()).tokens == 32  # another tail: blocks only
    salted = kv.lookup(turn, (), root=12345)
    assert salted.tokens == 0
    reused, _ = runner.prefill(turn, prefix.kv)
    recomputed, _ = runner.prefill(turn, None)
    assert torch.allclose(reused, recomputed, atol=1e-4)
