"""The connector's plans: the built-in worker's keys, lookups, stores and the scheduler half
(with fake vLLM requests and a fake sidecar at the unit boundary; test_vllm_e2e.py runs the
same path in the real vLLM against the real sidecar)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_connector.config import ConnectorConfig
from vllm_connector.plan import Planner
from vllm_connector.scheduler import SchedulerSide
from worker.kv.hashing import KeyMaker, salt_root
from worker.kv.l1 import L1Cache
from worker.kv.manager import CachedPrefix, KVManager
from worker.kv.sidecar import StoreJob

TAGS = (("s", "sess"),)
KEYS = KeyMaker("tiny", "bfloat16", 0)


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4000) for _ in range(n)]


class RecordingSidecar:
    """What KVManager.store submits, keyed (the built-in worker's writes)."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}

    def submit(self, job: StoreJob) -> bool:
        for key, kv in job.blocks:
            self.keys[key] = int(kv.shape[3])
        return True


def test_the_connector_names_blocks_exactly_as_the_builtin_worker_does() -> None:
    seq = ids(600)
    side = RecordingSidecar()
    worker = KVManager(L1Cache(1 << 20), side, KEYS, 256)  # type: ignore[arg-type]
    kv = torch.zeros(2, 1, 1, 600, 2)
    root = salt_root("tenant-salt")
    worker.store(seq, kv, TAGS, CachedPrefix(None), "sess", root)
    # the worker's tails are 16-token multiples; a connector set to 16 writes the same blocks
    planner = Planner(KEYS, 256, 16)
    planned = planner.stores(seq, 600, TAGS, root, skip=set())
    assert {p.key: p.length for p in planned} == side.keys
    # and finds all of them: all but < 16 tokens of the sequence
    found = planner.lookup([*seq, 1, 2], 601, TAGS, root, many(side.keys))
    assert found.tokens == 592 and [p.length for p in found.pieces] == [256, 256, 80]
    # at vLLM's CPU block size (128) only whole chunks and 128-token tails are shared
    coarse = Planner(KEYS, 256, 128).lookup([*seq, 1], 600, TAGS, root, many(side.keys))
    assert coarse.tokens == 512


def many(keys: set[str] | dict[str, int]) -> Callable[[list[str]], list[bool]]:
    """The sidecar's pipelined EXIST over a set of stored keys."""
    return lambda asked: [k in keys for k in asked]


def test_a_lookup_is_one_round_trip_to_the_sidecar() -> None:
    seq = ids(1000)
    planner = Planner(KEYS, 256, 128)
    stored = {p.key for p in planner.stores(seq, 1000, TAGS, 0, skip=set())}
    calls: list[list[str]] = []

    def exists_many(keys: list[str]) -> list[bool]:
        calls.append(keys)
        return [k in stored for k in keys]

    assert planner.lookup(seq, 999, TAGS, 0, exists_many).tokens == 896
    # one call: the 3 full chunks, and one 128-token tail candidate at each of the 4 chunk
    # boundaries (0, 256, 512, 768)
    assert len(calls) == 1 and len(calls[0]) == 3 + 4


def test_lookup_stops_at_the_first_missing_chunk_and_caps_at_usable() -> None:
    seq = ids(1000)
    planner = Planner(KEYS, 256, 128)
    stored = {p.key for p in planner.stores(seq, 1000, TAGS, 0, skip=set())}
    assert planner.lookup(seq, 999, TAGS, 0, many(stored)).tokens == 896  # 3 chunks + 128
    assert planner.lookup(seq, 700, TAGS, 0, many(stored)).tokens == 700
    first = planner.stores(seq, 1000, TAGS, 0, skip=set())[0].key
    holes = stored - {first}
    assert planner.lookup(seq, 999, TAGS, 0, many(holes)).tokens == 0
    assert planner.lookup(seq, 999, (("s", "other"),), 0, many(stored)).tokens == 0
    assert planner.lookup(seq, 999, TAGS, 7, many(stored)).tokens == 0  # another salt


def test_stores_skip_what_the_sidecar_has_and_cut_the_tail_to_the_block_size() -> None:
    seq = ids(700)
    planner = Planner(KEYS, 256, 128)
    everything = planner.stores(seq, 700, TAGS, 0, skip=set())
    assert [(p.begin, p.length) for p in everything] == [(0, 256), (256, 256), (512, 128)]
    rest = planner.stores(seq, 700, TAGS, 0, skip={everything[0].key})
    assert [p.begin for p in rest] == [256, 512]
    assert Planner(KEYS, 256, 0).stores(seq, 700, TAGS, 0, skip=set())[-1].length == 256


@dataclass
class FakeRequest:
    """The fields the connector reads of vLLM's `Request`."""

    request_id: str
    all_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = field(
        default_factory=lambda: {"lmcache.tag.s": "sess"}
    )
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class FakeClient:
    def __init__(self, keys: set[str], fail: bool = False) -> None:
        self.keys, self.fail, self.calls = keys, fail, 0

    def exists_many(self, keys: list[str]) -> list[bool]:
        self.calls += 1
        if self.fail:
            raise ConnectionError("down")
        return [key in self.keys for key in keys]

    def close(self) -> None:
        pass


def scheduler(keys: set[str], **config: Any) -> tuple[SchedulerSide, FakeClient]:
    client = FakeClient(keys)
    cfg = ConnectorConfig(sidecar_url="lm://127.0.0.1:1", **config)
    return SchedulerSide(cfg, Planner(KEYS, 256, 128), lambda: client), client  # type: ignore[arg-type,return-value]


def stored_keys(seq: list[int], valid: int, salt: str | None = None) -> set[str]:
    planner = Planner(KEYS, 256, 128)
    return {p.key for p in planner.stores(seq, valid, TAGS, salt_root(salt), skip=set())}


def test_the_scheduler_loads_what_the_sidecar_has_beyond_the_local_prefix() -> None:
    seq = ids(1100)
    side, client = scheduler(stored_keys(seq, 1000))
    req = FakeRequest("r1", seq)
    assert side.matched_tokens(req, 0) == 896
    calls = client.calls
    assert side.matched_tokens(req, 0) == 896 and client.calls == calls  # asked again: cached
    assert side.matched_tokens(req, 512) == 384  # vLLM's prefix cache had 4 blocks
    side.after_alloc(req, [10, 11, 12, 13, 14, 15, 16, 17, 18], 384)
    (load,) = side.build(SimpleNamespace()).loads
    assert (load.start, load.end, load.block_ids[0]) == (512, 896, 10)
    assert [(p.begin, p.length) for p in load.pieces] == [(512, 256), (768, 128)]
    assert side.build(SimpleNamespace()).loads == []  # planned once, sent once


def test_a_planned_load_goes_out_whatever_the_step_lists() -> None:
    """A load's blocks come from vLLM's allocation, so a request that a step does not list
    among its new ones (a resumed one, say) still gets its load, never a silent drop after
    vLLM has counted its tokens as computed."""
    seq = ids(1100)
    side, _ = scheduler(stored_keys(seq, 1000))
    req = FakeRequest("r1", seq)
    assert side.matched_tokens(req, 0) == 896
    side.after_alloc(req, list(range(20, 29)), 896)
    plan = side.build(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=["r1"], new_block_ids=[None]),
        )
    )
    (load,) = plan.loads
    assert (load.start, load.end, load.block_ids) == (0, 896, list(range(20, 29)))


def test_an_async_load_that_failed_is_not_planned_again_for_its_request() -> None:
    """vLLM asks again for a request whose async load left nothing usable: the same broken
    blocks would be planned forever, so the request is computed instead."""
    seq = ids(1100)
    side, _ = scheduler(stored_keys(seq, 1000), async_loads=True)
    req, other = FakeRequest("r1", seq), FakeRequest("r2", seq)
    assert side.matched_tokens(req, 0) == 896 and side.matched_tokens(other, 0) == 896
    side.after_alloc(req, list(range(20, 29)), 896)
    side.after_alloc(other, list(range(30, 39)), 896)
    assert len(side.build(SimpleNamespace()).loads) == 2
    side.loads_reported({"r1", "r2"}, failed_blocks={20, 21})  # r1's failed, r2's was whole
    assert side.matched_tokens(req, 0) == 0  # recomputed, not loaded again
    assert side.matched_tokens(other, 0) == 896  # (asked again after a preemption, say)
    side.finished(req, [])
    assert side.matched_tokens(req, 0) == 896  # forgotten with its request


def test_small_hits_session_less_requests_and_a_down_sidecar_load_nothing() -> None:
    seq = ids(1100)
    side, _ = scheduler(stored_keys(seq, 1000), min_load_tokens=200)
    assert side.matched_tokens(FakeRequest("r1", seq), 768) == 0  # 128 more: not worth it
    assert side.matched_tokens(FakeRequest("r2", seq, kv_transfer_params=None), 0) == 0
    bad = FakeRequest("r3", seq, kv_transfer_params={"lmcache.tag.s@x": "y"})
    assert side.matched_tokens(bad, 0) == 0
    down, client = scheduler(stored_keys(seq, 1000))
    client.fail = True
    assert down.matched_tokens(FakeRequest("r4", seq), 0) == 0
    calls = client.calls
    assert down.matched_tokens(FakeRequest("r5", seq), 0) == 0
    assert client.calls == calls  # the breaker is open: the sidecar is not asked again
    assert down.counters.drain()["sidecar_errors"] == 1


def test_a_finished_request_stores_its_generated_tokens_too() -> None:
    prompt = ids(600)
    side, _ = scheduler(stored_keys(prompt, 512))
    req = FakeRequest("r1", prompt)
    assert side.matched_tokens(req, 0) == 512
    req.all_token_ids = [*prompt, *ids(100, seed=1)]  # 100 generated
    req.num_computed_tokens = 699  # the last sampled token has no KV yet
    assert side.finished(req, list(range(6))) is True  # keep the blocks until they are read
    plan = side.build(
        SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[]),
        )
    )
    (store,) = plan.stores
    assert [(p.begin, p.length) for p in store.pieces] == [(512, 128)]  # chunks 0-1 were there
    assert store.session == "sess" and store.block_ids == list(range(6))
    short = FakeRequest("r2", ids(100), num_computed_tokens=99)
    assert side.finished(short, [0]) is False  # under a block: nothing to store


@pytest.mark.parametrize(
    "extra", [{"sidecar_url": "redis://x"}, {"sidecar_url": "lm://h:1", "x": 1}]
)
def test_bad_connector_settings_are_refused(extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ConnectorConfig.from_extra(extra)
