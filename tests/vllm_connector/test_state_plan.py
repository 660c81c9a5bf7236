"""Recurrent state (vLLM's `MambaSpec` groups in 'align'): the groups served (`groups`), the
plans (`state_plan`), the state side's bytes and sidecar calls (`state_worker`, a fake
client at the unit boundary) and the connector's scheduler half. No engine: the real one
is tests/vllm_connector/test_vllm_hybrid.py."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sidecar.client import KVBlock
from sidecar.protocol import DTYPE_UINT8, FMT_BINARY
from tests.vllm_connector.test_connector_refusal import (
    BLOCK,
    LAYERS,
    EverythingSidecar,
    full,
    kv_cache_config,
    sidecar,  # noqa: F401 (a fixture)
    vllm_config,
)
from tests.vllm_connector.test_plan import FakeRequest, ids
from vllm_connector.config import ConnectorConfig
from vllm_connector.group_plan import NULL_BLOCK, Group
from vllm_connector.paged import rank_key
from vllm_connector.plan import LoadSpec, Piece, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.state_plan import StatePlanner
from vllm_connector.state_worker import StateSide, state_tensors
from worker.kv.hashing import KeyMaker

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    from vllm_connector.connector import CtxcacheConnector, CtxcacheMetadata
    from vllm_connector.groups import STATE_VERSION, served_groups, state_tag

TAGS = (("s", "sess"),)
KEYS = KeyMaker("tiny", "bfloat16", 0)
TAG = f"{STATE_VERSION}.0badcafe"
CONFIG = ConnectorConfig(sidecar_url="lm://127.0.0.1:1")


def state_spec(
    shapes: tuple[tuple[int, ...], ...] = ((3, 64), (4, 8, 8)),
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32),
    **kw: Any,
) -> MambaSpec:
    kw.setdefault("mamba_cache_mode", "align")
    return MambaSpec(block_size=BLOCK, shapes=shapes, dtypes=dtypes, **kw)


# -- served_groups --------------------------------------------------------------------------
def test_an_align_state_group_is_served_beside_full_attention_under_its_layout_tag() -> None:
    spec = state_spec()
    layers = [(f"{LAYERS[0]}.0",), (f"{LAYERS[0]}.1",)]
    groups = served_groups(kv_cache_config(full(), spec))
    assert groups == [Group(0, layers[0], BLOCK), Group(1, layers[1], BLOCK, state=state_tag(spec))]
    assert state_tag(spec).startswith(f"{STATE_VERSION}.")
    assert state_tag(spec) == state_tag(state_spec())  # (a digest, the same in every process)
    tags = {
        state_tag(spec),
        state_tag(state_spec(dtypes=(torch.bfloat16, torch.bfloat16))),
        state_tag(state_spec(shapes=((3, 64), (4, 8, 16)))),
    }
    assert len(tags) == 3


SLIDING = SlidingWindowSpec(
    block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=64
)
REFUSED = {
    "mode-none": ((full(), state_spec(mamba_cache_mode="none")), "mamba_cache_mode 'none'"),
    "speculative": ((full(), state_spec(num_speculative_blocks=2)), "2 speculative state blocks"),
    "beside-sliding": ((full(), SLIDING, state_spec()), "beside sliding-window layers"),
    "alone": ((state_spec(),), "beside no full attention"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_state_groups_the_connector_cannot_serve_are_refused_in_words(case: str) -> None:
    specs, why = REFUSED[case]
    refused = served_groups(kv_cache_config(*specs))
    assert isinstance(refused, str) and why in refused, refused


# -- StatePlanner ---------------------------------------------------------------------------
def planner(bs: int) -> StatePlanner:
    groups = [Group(0, ("attn",), bs), Group(1, ("gdn",), bs, state=TAG)]
    return StatePlanner(groups, KEYS, 256)


def tables(tokens: int, bs: int) -> tuple[list[int], list[int]]:
    """A finished request's tables: full attention's blocks, the state group's (distinct
    ids, so which one a plan reads shows)."""
    n = -(-tokens // bs)
    return list(range(1, n + 1)), list(range(100, 100 + n))


def store(plan: StatePlanner, seq: list[int], bs: int, skip: set[str] | None = None) -> set[str]:
    specs = plan.store_specs("r", "sess", seq, TAGS, 0, skip or set(), tables(len(seq), bs))
    return {p.key for s in specs for p in s.pieces}


class Sidecar:
    def __init__(self, keys: set[str]) -> None:
        self.keys, self.calls = keys, 0

    def exists_many(self, keys: list[str]) -> list[bool]:
        self.calls += 1
        return [k in self.keys for k in keys]


@pytest.mark.parametrize("bs", [1152, 128])
@pytest.mark.parametrize("valid", [200, 1000, 2304, 2500])
def test_a_store_is_chunks_an_exact_tail_and_the_state_after_the_last_token(
    bs: int, valid: int
) -> None:
    seq = ids(valid, seed=valid)
    full_t, state_t = tables(valid, bs)
    specs = planner(bs).store_specs("r", "sess", seq, TAGS, 0, set(), (full_t, state_t))
    by = {s.group: s for s in specs}
    assert sorted(by) == [0, 1]
    base = valid // 256 * 256
    want = [(b, b + 256) for b in range(0, base, 256)] + ([(base, valid)] * (valid > base))
    assert [(p.begin, p.end) for p in by[0].pieces] == want  # (2304: no tail)
    assert by[0].block_ids == full_t
    (piece,) = by[1].pieces
    assert (piece.begin, piece.length) == (valid, 0)
    assert by[1].block_ids == [state_t[(valid - 1) // bs]]
    assert piece.key.startswith("tiny#g1@") and f"@rs%{TAG}@" in piece.key
    # vLLM no longer holds that block (its null block; a table too short): nothing stored
    state_t[(valid - 1) // bs] = NULL_BLOCK
    assert planner(bs).store_specs("r", "sess", seq, TAGS, 0, set(), (full_t, state_t)) == []
    short = state_t[: (valid - 1) // bs]
    assert planner(bs).store_specs("r", "sess", seq, TAGS, 0, set(), (full_t, short)) == []


@pytest.mark.parametrize("bs", [1152, 128])
def test_the_next_turn_finds_the_whole_history_in_two_round_trips(bs: int) -> None:
    seq = ids(1000)
    plan = planner(bs)
    side = Sidecar(store(plan, seq, bs))
    turn = [*seq, *ids(60, seed=1)]
    lookup = plan.lookup(turn, len(turn) - 1, TAGS, 0, side.exists_many)
    assert lookup.tokens == 1000 and side.calls == 2
    spans = [(p.begin, p.end) for p in lookup.by_group[0]]
    assert spans == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert [(p.begin, p.length) for p in lookup.by_group[1]] == [(1000, 0)]
    assert {p.key for p in lookup.pieces} <= side.keys
    # the chunks found are skipped by the request's own store; the new ones are put
    more = [*turn, *ids(240, seed=2)]
    assert len(lookup.found) == 3
    skipped = planner(bs).store_specs(
        "r2", "sess", more, TAGS, 0, lookup.found, tables(len(more), bs)
    )
    spans = [(p.begin, p.end) for s in skipped if s.group == 0 for p in s.pieces]
    assert spans == [(768, 1024), (1024, 1280), (1280, 1300)]
    assert not {p.key for s in skipped for p in s.pieces} & lookup.found


@pytest.mark.parametrize("case", ["diverges", "no-state", "no-tail"])
def test_without_the_state_and_the_tail_at_the_same_end_there_is_no_hit(case: str) -> None:
    bs = 1152
    seq = ids(1000)
    plan = planner(bs)
    specs = plan.store_specs("r", "sess", seq, TAGS, 0, set(), tables(1000, bs))
    by = {s.group: s for s in specs}
    stored = {p.key for s in specs for p in s.pieces}
    turn = [*seq, *ids(60, seed=1)]
    if case == "diverges":  # inside the last chunk, [768, 1024): the chunks up to it match
        turn[900] = 1 + turn[900]
    elif case == "no-state":
        stored.discard(by[1].pieces[0].key)
    else:
        stored.discard(by[0].pieces[-1].key)
    side = Sidecar(stored)
    lookup = plan.lookup(turn, len(turn) - 1, TAGS, 0, side.exists_many)
    assert lookup.tokens == 0 and lookup.pieces == [] and side.calls == 2
    assert len(lookup.found) == 3  # (the chunks are there: found, but no state to go on)


def test_a_state_on_a_chunk_boundary_needs_no_tail() -> None:
    bs = 128
    seq = ids(768)
    plan = planner(bs)
    stored = store(plan, seq, bs)
    assert len(stored) == 4  # 3 chunks, the state
    for turn in ([*seq, *ids(50, seed=4)], [*seq, 7]):
        lookup = plan.lookup(turn, len(turn) - 1, TAGS, 0, Sidecar(stored).exists_many)
        assert lookup.tokens == 768
        assert [(p.begin, p.end) for p in lookup.by_group[0]] == [(0, 256), (256, 512), (512, 768)]


def test_no_hit_goes_beyond_the_usable_end() -> None:
    bs = 128
    seq = ids(1000)
    plan = planner(bs)
    stored = store(plan, seq[:600], bs) | store(plan, seq, bs)  # two turns of a session
    turn = [*seq, *ids(60, seed=1)]
    hits = {
        usable: plan.lookup(turn, usable, TAGS, 0, Sidecar(stored).exists_many).tokens
        for usable in (1059, 1000, 999, 700, 599)
    }
    # (999: the run reaches 768, and the state at 600 is below it: not looked for)
    assert hits == {1059: 1000, 1000: 1000, 999: 0, 700: 600, 599: 0}


def test_a_load_writes_what_vllm_lacks_and_the_state_into_the_block_for_its_end() -> None:
    bs = 128
    seq = ids(1000)
    plan = planner(bs)
    stored = store(plan, seq, bs)
    lookup = plan.lookup([*seq, 5], 1000, TAGS, 0, Sidecar(stored).exists_many)
    assert lookup.tokens == 1000
    full_t = list(range(1, 9))
    state_t = [NULL_BLOCK] * 6 + [40, 41]  # (align: the blocks before the last are null)
    loads = plan.load_specs("r2", lookup, 1000 - 512, (full_t, state_t))
    by = {s.group: s for s in loads}
    assert (by[0].start, by[0].end, by[0].block_ids) == (512, 1000, full_t)  # vLLM had 512
    assert [(p.begin, p.end) for p in by[0].pieces] == [(512, 768), (768, 1000)]
    assert (by[1].start, by[1].end, by[1].block_ids) == (1000, 1000, [41])  # (999 // 128)
    assert by[1].pieces == lookup.by_group[1]
    # no block for it: a load with no block id, which the state side fails
    loads = plan.load_specs("r3", lookup, 1000, (full_t, [NULL_BLOCK] * 8))
    (state,) = [s for s in loads if s.group == 1]
    assert state.block_ids == [] and state.pieces
    side = StateSide(CONFIG)
    side.load(StepPlan(loads=[state]))
    assert side.take_loaded_blocks() == {"r3": True}


# -- StateSide ------------------------------------------------------------------------------
NB, CONV, REC, PAD = 8, 3 * 64 * 2, 4 * 8 * 8 * 4, 128
PAGE = CONV + REC + PAD


def paged_layer() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One layer's state as vLLM lays it: a raw buffer of padded pages, a bf16 conv state
    and a float32 recurrent state as strided views of it."""
    raw = torch.zeros(NB * PAGE, dtype=torch.uint8)
    conv = raw.view(torch.bfloat16).as_strided((NB, 3, 64), (PAGE // 2, 64, 1))
    rec = raw.view(torch.float32).as_strided((NB, 4, 8, 8), (PAGE // 4, 64, 8, 1), CONV // 4)
    return raw, [conv, rec]


def registered(rank: int = 0) -> tuple[StateSide, list[torch.Tensor]]:
    side = StateSide(CONFIG, rank)
    (raw0, l0), (raw1, l1) = paged_layer(), paged_layer()
    side.register({"l.0": l0, "l.1": l1})
    assert side.off is None and side.shape == (STATE_VERSION, 2, 4, 2 * (CONV + REC))
    return side, [raw0.view(NB, PAGE), raw1.view(NB, PAGE)]


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    rng = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng)


def test_a_state_block_is_read_and_written_in_place_in_vllms_pages() -> None:
    side, pages = registered()
    data = random_bytes(side.block_bytes)
    side.write(5, data)
    assert torch.equal(side.read(5), data)
    for page, at in zip(pages, (0, CONV + REC), strict=True):  # layer by layer
        assert torch.equal(page[5, : CONV + REC], data[at : at + CONV + REC])
        assert not page[5, CONV + REC :].any()  # the page's padding untouched
        assert not torch.cat([page[:5], page[6:]]).any()  # and every other block
    conv = side.tensors[0]
    assert torch.equal(conv[5].contiguous().view(torch.uint8).reshape(-1), data[:CONV])
    conv[2].fill_(1.5)  # (vLLM's kernels write the views)
    assert torch.equal(side.read(2)[:CONV], conv[2].contiguous().view(torch.uint8).reshape(-1))


def test_a_state_whose_first_tensor_ends_off_the_next_ones_alignment_round_trips() -> None:
    side = StateSide(CONFIG)
    side.register({"l": [torch.zeros(NB, 3, 63, dtype=torch.bfloat16), torch.zeros(NB, 4)]})
    data = random_bytes(side.block_bytes)
    side.write(1, data)
    assert torch.equal(side.read(1), data)


def test_state_tensors_are_a_layers_kv_cache_flat_or_per_virtual_engine() -> None:
    a, b = torch.zeros(4, 2), torch.zeros(4, 3)
    for cache in ((a, b), [a, b], [[a, b]], [(a, b)]):
        got = state_tensors(SimpleNamespace(kv_cache=cache))
        assert len(got) == 2 and got[0] is a and got[1] is b
    with pytest.raises(TypeError):
        state_tensors(SimpleNamespace(kv_cache=[]))


class FakeBlocks:
    """The sidecar at the state side's boundary (`BlockClient`'s get and put)."""

    def __init__(self) -> None:
        self.blocks: dict[str, KVBlock] = {}
        self.fail = False
        self.gets = 0

    def put(self, key: str, data: Any, *, fmt: int, dtype: int, shape: Any) -> None:
        if self.fail:
            raise ConnectionError("down")
        self.blocks[key] = KVBlock(bytearray(data), fmt, dtype, tuple(shape))

    def get(self, key: str) -> KVBlock | None:
        self.gets += 1
        if self.fail:
            raise ConnectionError("down")
        return self.blocks.get(key)

    def close(self) -> None:
        return None


def loaded(side: StateSide, timeout: float = 5.0) -> dict[str, bool]:
    """The state loads over (the io thread's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = side.take_loaded_blocks()
        if out:
            return out
        time.sleep(0.01)
    return {}


STATE_KEY = KeyMaker("tiny#g1", "bfloat16", 0, 2, (("rs", TAG),)).key(12345, TAGS)


def load(side: StateSide, block: int) -> dict[str, bool]:
    side.load(StepPlan(loads=[LoadSpec("r2", 1000, 1000, [Piece(STATE_KEY, 1000, 0)], [block])]))
    return loaded(side)


def test_a_state_block_is_put_under_the_ranks_key_and_loaded_back() -> None:
    side, pages = registered(rank=1)
    client = FakeBlocks()
    side._make_client = lambda: client  # type: ignore[assignment,return-value]
    side.write(5, random_bytes(side.block_bytes, seed=3))
    side.save(StepPlan(stores=[StoreSpec("r", "sess", [Piece(STATE_KEY, 1000, 0)], [5])]))
    assert side.take_sent() == {"r"}  # copied out in the step: vLLM may free the block
    side.write(5, torch.zeros(side.block_bytes, dtype=torch.uint8))  # (reused at once)
    side.close()  # (waits for the io thread)
    ((key, block),) = client.blocks.items()
    assert key == rank_key(STATE_KEY, 1) != STATE_KEY and "@2@1@" in key
    assert (block.fmt, block.dtype, block.shape) == (FMT_BINARY, DTYPE_UINT8, side.shape)
    assert bytes(block.data) == bytes(random_bytes(side.block_bytes, seed=3).numpy())
    try:
        assert load(side, 2) == {"r2": False}
        assert torch.equal(side.read(2), random_bytes(side.block_bytes, seed=3))
        assert not pages[0][:2].any() and not pages[0][3:].any()
        assert side.counters.drain().get("state_load_bytes") == side.block_bytes
    finally:
        side.close()


@pytest.mark.parametrize("case", ["missing", "wrong-shape", "wrong-format", "short", "raises"])
def test_a_state_load_that_cannot_be_written_fails_its_request_and_nothing_else(
    case: str,
) -> None:
    side, pages = registered()
    client = FakeBlocks()
    side._make_client = lambda: client  # type: ignore[assignment,return-value]
    n, shape = side.block_bytes, side.shape
    payload = {
        "wrong-shape": KVBlock(bytearray(b"\xff" * n), FMT_BINARY, DTYPE_UINT8, (1, 1, 8, n)),
        "wrong-format": KVBlock(bytearray(b"\xff" * n), FMT_BINARY + 1, DTYPE_UINT8, shape),
        "short": KVBlock(bytearray(b"\xff" * (n - 1)), FMT_BINARY, DTYPE_UINT8, shape),
    }.get(case)
    if payload is not None:
        client.blocks[STATE_KEY] = payload
    client.fail = case == "raises"
    try:
        assert load(side, 2) == {"r2": True}  # (never raised: the io thread reported it)
        assert not pages[0].any() and not pages[1].any()
        assert side.breaker.closed == (case != "raises")
        if case == "raises":  # the breaker open: the next load fails without a call
            assert load(side, 3) == {"r2": True} and client.gets == 1
    finally:
        side.close()


# -- the connector --------------------------------------------------------------------------
def test_the_scheduler_half_serves_a_state_model_and_stores_only_an_exact_end(
    sidecar: EverythingSidecar,  # noqa: F811
) -> None:
    kv = kv_cache_config(full(), state_spec())
    connector = CtxcacheConnector(vllm_config(), KVConnectorRole.SCHEDULER, kv)
    try:
        assert connector.refused is None and connector.scheduler is not None
        assert isinstance(connector.scheduler.planner, StatePlanner)
        request = FakeRequest("r1", ids(300))
        assert connector.get_loaded_kv_cache_group_ids(request) == ()  # type: ignore[arg-type]
        matched, is_async = connector.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
        assert (matched, is_async, sidecar.calls) == (299, True, 2)  # every key is there
        n = -(-300 // BLOCK)
        held = (list(range(1, n + 1)), list(range(100, 100 + n)))
        for rid, in_flight, kept in (("r2", 1, False), ("r3", 0, True)):
            done = FakeRequest(rid, ids(300), num_computed_tokens=299)
            done.num_in_flight_tokens = in_flight  # (async scheduling: one more token)
            keep, _ = connector.request_finished_all_groups(done, held)  # type: ignore[arg-type]
            plan = connector.build_connector_meta(SimpleNamespace())  # type: ignore[arg-type]
            assert isinstance(plan, CtxcacheMetadata) and keep == kept
            assert sorted(s.group for s in plan.stores) == ([0, 1] if kept else [])
        state = next(s for s in plan.stores if s.group == 1)
        assert state.block_ids == [held[1][298 // BLOCK]] and state.pieces[0].begin == 299
    finally:
        connector.shutdown()
