"""A model of several KV cache groups (vLLM's hybrid KV cache manager on): full attention
beside sliding windows. Unit level: the plans (`group_plan`), the groups vLLM's specs make
(`groups`), the connector's hooks with vLLM's objects, the worker half's reports; the real
engine is tests/vllm_connector/test_vllm_sliding.py."""

from __future__ import annotations

import itertools
import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

from tests.vllm_connector.test_connector_refusal import (
    BLOCK,
    EverythingSidecar,
    full,
    sidecar,  # noqa: F401 (a fixture)
    vllm_config,
)
from tests.vllm_connector.test_plan import FakeRequest, ids
from vllm_connector.config import ConnectorConfig
from vllm_connector.group_plan import NULL_BLOCK, Group, GroupLookup, GroupPlanner
from vllm_connector.group_worker import GroupWorker
from vllm_connector.plan import LoadSpec, StoreSpec
from vllm_connector.scheduler import StepPlan
from worker.kv.hashing import KeyMaker

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorRole,
        supports_hma,
    )
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_connector.connector import CtxcacheConnector, CtxcacheMetadata
    from vllm_connector.groups import served_groups

TAGS = (("s", "sess"),)
KEYS = KeyMaker("tiny", "bfloat16", 0)
BS = 128  # vLLM's CPU block size
WINDOW = 512
FULL = Group(0, ("model.layers.1.self_attn.attn",), BS)
SLIDING = Group(1, ("model.layers.0.self_attn.attn",), BS, WINDOW)


def planner() -> GroupPlanner:
    return GroupPlanner([FULL, SLIDING], KEYS, 256, BS)


def held(group: Group, tokens: int, first_id: int) -> list[int]:
    """A group's block table as vLLM hands it over once `tokens` are computed: for a
    sliding window, its null block before the window."""
    n = -(-tokens // group.block_size)
    nulls = group.first_kept(tokens) // group.block_size
    return [NULL_BLOCK] * nulls + list(range(first_id + nulls, first_id + n))


def stored_keys(specs: list[StoreSpec]) -> set[str]:
    return {p.key for spec in specs for p in spec.pieces}


def test_a_sliding_group_stores_its_last_window_and_a_full_group_everything() -> None:
    seq = ids(1000)
    blocks = (held(FULL, 1000, 1), held(SLIDING, 1000, 20))
    specs = planner().store_specs("r", "sess", seq, TAGS, 0, set(), blocks)
    by_group = {spec.group: spec for spec in specs}
    full_spans = [(p.begin, p.end) for p in by_group[0].pieces]
    assert full_spans == [(0, 256), (256, 512), (512, 768), (768, 896)]  # chunks, tail
    # vLLM holds the sliding group's blocks from the one with token 1000 - 512 + 1 = 489
    slide_spans = [(p.begin, p.end) for p in by_group[1].pieces]
    assert slide_spans == [(384, 512), (512, 640), (640, 768), (768, 896)]
    assert by_group[1].block_ids[:3] == [NULL_BLOCK] * 3
    # each group its own key space: no key is shared
    assert not {p.key for p in by_group[0].pieces} & {p.key for p in by_group[1].pieces}
    assert all("tiny#g1@" in p.key for p in by_group[1].pieces)


def test_the_next_turn_finds_the_history_and_loads_each_group_its_part() -> None:
    seq = ids(1000)
    plan = planner()
    blocks = (held(FULL, 1000, 1), held(SLIDING, 1000, 20))
    stored = stored_keys(plan.store_specs("r", "sess", seq, TAGS, 0, set(), blocks))
    calls: list[int] = []

    def exists_many(keys: list[str]) -> list[bool]:
        calls.append(len(keys))
        return [k in stored for k in keys]

    turn = [*seq, *ids(60, seed=1)]
    lookup = plan.lookup(turn, len(turn) - 1, TAGS, 0, exists_many)
    assert len(calls) == 1  # one round trip for both groups
    assert isinstance(lookup, GroupLookup) and lookup.tokens == 896
    # the window the next token needs: from the block holding 896 - 511 = 385
    new = (held(FULL, 896, 100), held(SLIDING, 896, 200))
    loads = plan.load_specs("r2", lookup, 896, new)
    spans = {spec.group: (spec.start, spec.end, len(spec.pieces)) for spec in loads}
    assert spans == {0: (0, 896, 4), 1: (384, 896, 4)}
    assert [spec.block_ids for spec in loads] == [new[0], new[1]]


def test_a_hit_needs_the_whole_window_or_it_is_shorter() -> None:
    seq = ids(1000)
    plan = planner()
    blocks = (held(FULL, 1000, 1), held(SLIDING, 1000, 20))
    stored = stored_keys(plan.store_specs("r", "sess", seq, TAGS, 0, set(), blocks))
    units = {
        p.begin: p.key
        for p in plan.lookup(seq, 999, TAGS, 0, lambda k: [True] * len(k)).by_group[1]
    }
    gone = stored - {units[768]}  # the window's last unit evicted
    lookup = plan.lookup(seq, 999, TAGS, 0, lambda keys: [k in gone for k in keys])
    # 896 and 768 need the unit [768, 896) or end in it; 640 needs [128, 640): 128 gone
    assert lookup.tokens == 0
    gone = stored - {units[384]}  # the window's first unit evicted
    lookup = plan.lookup(seq, 999, TAGS, 0, lambda keys: [k in gone | {units[768]} for k in keys])
    assert lookup.tokens == 0  # every hit up to 896 needs the block with token 385
    # an earlier turn's store (a shorter conversation) has the window a shorter hit needs
    gone = stored - {units[768]}
    early = stored_keys(
        plan.store_specs(
            "r0", "sess", seq[:700], TAGS, 0, set(), (held(FULL, 700, 1), held(SLIDING, 700, 20))
        )
    )
    lookup = plan.lookup(seq, 999, TAGS, 0, lambda keys: [k in gone | early for k in keys])
    assert lookup.tokens == 768  # the full group to 896, the window [256, 768) complete


def test_when_vllm_freed_the_block_a_grid_hit_needs_the_edge_end_is_stored() -> None:
    """1023 tokens: vLLM keeps the sliding group's blocks from token 1023 - 511 = 512 on,
    and the hit on the unit grid, 896, would need the block of token 385 — freed. So the
    store adds the shortest hit its blocks serve, 1023: a tail to it in the full group, the
    piece [896, 1023) in the sliding one; the next turn hits all of it."""
    seq = ids(1023)
    plan = planner()
    blocks = (held(FULL, 1023, 1), held(SLIDING, 1023, 20))
    specs = plan.store_specs("r", "sess", seq, TAGS, 0, set(), blocks)
    spans = {s.group: [(p.begin, p.end) for p in s.pieces] for s in specs}
    assert spans[0][-2:] == [(768, 896), (768, 1023)]
    assert spans[1] == [(512, 640), (640, 768), (768, 896), (896, 1023)]
    stored = stored_keys(specs)
    turn = [*seq, *ids(60, seed=2)]
    lookup = plan.lookup(turn, len(turn) - 1, TAGS, 0, lambda keys: [k in stored for k in keys])
    assert lookup.tokens == 1023
    loads = plan.load_specs("r2", lookup, 1023, (held(FULL, 1023, 1), held(SLIDING, 1023, 9)))
    assert [(s.group, s.start, s.end) for s in loads] == [(0, 0, 1023), (1, 512, 1023)]
    # one token fewer is on the usual side: no edge end stored
    shorter = plan.store_specs(
        "r", "sess", seq[:1022], TAGS, 0, set(), (held(FULL, 1022, 1), held(SLIDING, 1022, 20))
    )
    assert all(p.length % BS == 0 for s in shorter for p in s.pieces)


def test_a_short_conversation_is_all_window() -> None:
    seq = ids(400)
    plan = planner()
    blocks = (held(FULL, 400, 1), held(SLIDING, 400, 20))
    specs = plan.store_specs("r", "sess", seq, TAGS, 0, set(), blocks)
    assert [(p.begin, p.end) for p in specs[1].pieces] == [(0, 128), (128, 256), (256, 384)]
    stored = stored_keys(specs)
    lookup = plan.lookup([*seq, 5, 6], 401, TAGS, 0, lambda keys: [k in stored for k in keys])
    assert lookup.tokens == 384
    loads = plan.load_specs("r2", lookup, 384, (held(FULL, 384, 1), held(SLIDING, 384, 9)))
    assert [(s.group, s.start) for s in loads] == [(0, 0), (1, 0)]


def test_a_local_hit_leaves_the_load_only_what_vllm_lacks() -> None:
    seq = ids(1000)
    plan = planner()
    blocks = (held(FULL, 1000, 1), held(SLIDING, 1000, 20))
    stored = stored_keys(plan.store_specs("r", "sess", seq, TAGS, 0, set(), blocks))
    lookup = plan.lookup([*seq, 1], 1000, TAGS, 0, lambda keys: [k in stored for k in keys])
    # vLLM's own cache had 640 tokens: 256 more are loaded, in each group
    loads = plan.load_specs("r2", lookup, 256, (held(FULL, 896, 1), held(SLIDING, 896, 9)))
    assert [(s.group, s.start, s.end) for s in loads] == [(0, 640, 896), (1, 640, 896)]


def test_vllm_specs_make_the_groups_the_connector_serves() -> None:
    sliding = SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=WINDOW
    )
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["a.1", "a.3"],
                full().__class__(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.bfloat16),
            ),
            KVCacheGroupSpec(["a.0", "a.2"], sliding),
        ],
    )
    groups = served_groups(config)
    assert groups == [Group(0, ("a.1", "a.3"), BS), Group(1, ("a.0", "a.2"), BS, WINDOW)]


def hybrid_config(**extra: object) -> tuple[object, KVCacheConfig]:
    sliding = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64
    )
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l.1"], full()), KVCacheGroupSpec(["l.0"], sliding)],
    )
    return vllm_config(**extra), kv


def test_the_connector_is_hma_and_plans_a_hybrid_model_group_by_group(
    sidecar: EverythingSidecar,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert supports_hma(CtxcacheConnector)
    caplog.set_level(logging.INFO, logger="vllm_connector")
    config, kv = hybrid_config()
    connector = CtxcacheConnector(config, KVConnectorRole.SCHEDULER, kv)  # type: ignore[arg-type]
    assert connector.refused is None and connector.config.async_loads  # forced
    assert "2 KV cache groups served" in caplog.text
    request = FakeRequest("r1", ids(300), num_computed_tokens=300)
    matched, is_async = connector.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
    assert matched == 288 and is_async  # 4 chunks of 64 and a 32-token tail
    # vLLM's tables: window 64, so the sliding group's blocks from the one with 288 - 63
    tables = (list(range(1, 19)), [NULL_BLOCK] * 14 + list(range(30, 34)))
    blocks = SimpleNamespace(get_block_ids=lambda: tables)
    connector.update_state_after_alloc(request, blocks, 288)  # type: ignore[arg-type]
    plan = connector.build_connector_meta(SimpleNamespace())  # type: ignore[arg-type]
    assert isinstance(plan, CtxcacheMetadata)
    assert [(s.group, s.start, s.end) for s in plan.loads] == [(0, 0, 288), (1, 224, 288)]
    assert [s.block_ids for s in plan.loads] == list(tables)
    # a failed load, reported as vLLM's failed_recving: not looked up again
    connector.update_connector_output(
        KVConnectorOutput(finished_recving={"r1"}, failed_recving={"r1"})
    )
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
    # it ends 100 tokens later: each group stores what the lookup did not find
    request.all_token_ids += ids(100, seed=3)
    request.num_computed_tokens = 400
    tables = (list(range(1, 26)), [NULL_BLOCK] * 21 + list(range(30, 34)))
    keep, _ = connector.request_finished_all_groups(request, tables)  # type: ignore[arg-type]
    after = connector.build_connector_meta(SimpleNamespace())  # type: ignore[arg-type]
    assert isinstance(after, CtxcacheMetadata) and keep
    spans = {s.group: [(p.begin, p.end) for p in s.pieces] for s in after.stores}
    assert spans == {
        0: [(256, 320), (320, 384), (384, 400)],
        1: [(336, 352), (352, 368), (368, 384), (384, 400)],
    }
    connector.shutdown()


def test_the_worker_half_reports_a_request_once_every_group_is_done() -> None:
    config = ConnectorConfig(sidecar_url="lm://127.0.0.1:1", async_loads=True)
    worker = GroupWorker(config, [FULL, SLIDING])  # never registered: every load fails
    try:
        worker.load(
            StepPlan(
                loads=[
                    LoadSpec("a", 0, 256, [], [1, 2], group=0),
                    LoadSpec("a", 0, 256, [], [7, 8], group=1),
                ]
            )
        )
        assert worker.take_loaded() == {"a"}
        assert worker.take_failed() == {"a"}  # vLLM recomputes the request
        assert worker.take_invalid() == set()  # never blocks: their ids repeat across groups
        worker.save(
            StepPlan(
                stores=[
                    StoreSpec("b", "s", [], [1], group=0),
                    StoreSpec("b", "s", [], [2], group=1),
                ]
            )
        )
        assert worker.take_sent() == {"b"}
        assert worker.take_failed() == set()
    finally:
        worker.close()


@pytest.mark.parametrize(
    "groups",
    [
        # two windows beside full attention (vLLM makes a group per window)
        [FULL, SLIDING, Group(2, ("model.layers.2.self_attn.attn",), BS, 256)],
        # windows only (Mistral-7B-v0.1's kind: no full-attention group at all)
        [SLIDING],
        # a window that is no multiple of the block: the edge ends are most hits
        [FULL, Group(1, ("model.layers.0.self_attn.attn",), BS, 300)],
    ],
    ids=["two-windows", "windows-only", "window-300"],
)
@pytest.mark.parametrize("tokens", [1000, 1023, 1100, 1151, 1280])
def test_every_group_finds_what_the_last_turn_stored(groups: list[Group], tokens: int) -> None:
    """Whatever the length, the next turn reuses all but less than a block of the history,
    and each group loads exactly the blocks vLLM allocates for that hit."""
    plan = GroupPlanner(groups, KEYS, 256, BS)
    seq = ids(tokens, seed=tokens)
    blocks = [held(g, tokens, 1 + 100 * g.index) for g in groups]
    blocks += [[]] * (3 - len(blocks))  # (indexed by vLLM's group id)
    if len(groups) == 1:
        blocks = [[], blocks[0], []]
    stored = stored_keys(plan.store_specs("r", "sess", seq, TAGS, 0, set(), blocks))
    turn = [*seq, *ids(40, seed=9)]
    lookup = plan.lookup(turn, len(turn) - 1, TAGS, 0, lambda keys: [k in stored for k in keys])
    assert tokens - BS < lookup.tokens <= tokens
    new = [held(g, lookup.tokens, 1000 + 100 * g.index) for g in groups]
    new += [[]] * (3 - len(new))
    if len(groups) == 1:
        new = [[], new[0], []]
    for spec in plan.load_specs("r2", lookup, lookup.tokens, new):
        group = next(g for g in groups if g.index == spec.group)
        assert spec.start == group.first_kept(lookup.tokens)
        assert spec.end == lookup.tokens
        covered = sorted((p.begin, p.end) for p in spec.pieces)
        assert covered[0][0] <= spec.start and covered[-1][1] >= spec.end
        assert all(a[1] >= b[0] for a, b in itertools.pairwise(covered))
        # every block the load writes is one vLLM allocated (none of its null block)
        first, last = spec.start // BS, (spec.end - 1) // BS
        assert NULL_BLOCK not in spec.block_ids[first : last + 1]
