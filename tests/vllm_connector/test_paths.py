"""The connector's worker half on both data paths, against a real sidecar (no vLLM: random
paged caches in FlashAttention's layout, written by a plain-torch cache write).

What a user would notice: KV stored by one request is loaded into another's blocks exactly;
the shm path is taken when the sidecar is local and says so in its counters; a block this
engine cannot read, a copy that raced its lease, or a sidecar that died mid-load is a miss
(the blocks are reported for recompute), never wrong KV and never an exception.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.kvpath.kvpath import flash_writer as flash_writer_of
from ctxcache.net import free_port
from sidecar.local_client import ReadLease
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)
from vllm_connector import regions
from vllm_connector.config import ConnectorConfig
from vllm_connector.layout import gather, token_slots
from vllm_connector.plan import LoadSpec, Piece, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.worker import WorkerSide

N, HEADS, DIM, LAYERS = 16, 2, 32, 3
BLOCKS = 40
TOKENS = 200  # 12 whole blocks and a partial one: the edge goes through the indexed path


def caches(transposed: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(LAYERS):
        if transposed:  # another layout: [blocks, H, N, 2D] stored as it is
            cache = torch.randn(BLOCKS, HEADS, N, 2 * DIM).to(torch.bfloat16)
        else:
            cache = torch.randn(BLOCKS, N, HEADS, 2 * DIM).to(torch.bfloat16).transpose(1, 2)
        out[f"layer.{layer}"] = cache
    return out


def plain_writer(
    k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    key_cache, value_cache = cache.split(DIM, dim=-1)  # [B, H, N, D]
    key_cache[slots // N, :, slots % N] = k
    value_cache[slots // N, :, slots % N] = v


@pytest.fixture
def sidecar(local_dir: Path) -> Iterator[Sidecar]:
    sc = Sidecar(SidecarSettings(port=0, memory_bytes=64 << 20, local_dir=local_dir)).start()
    try:
        yield sc
    finally:
        sc.stop()


def worker(
    sidecar: Sidecar,
    local: Path | None,
    *,
    transposed: bool = False,
    chunk: int = 64,
    async_loads: bool = False,
) -> WorkerSide:
    config = ConnectorConfig(
        sidecar_url=f"lm://127.0.0.1:{sidecar.port}",
        local_dir=str(local) if local else None,
        chunk_size=chunk,
        async_loads=async_loads,
    )
    side = WorkerSide(config, N)
    write = plain_writer if transposed else flash_writer_of(N, DIM)
    side.register(caches(transposed), {k: (write, HEADS, DIM) for k in caches(transposed)})
    assert side.enabled
    return side


def pieces(tag: str, tokens: int = TOKENS, chunk: int = 64) -> list[Piece]:
    return [
        Piece(f"m@1@0@{tag}{i:x}@bfloat16@s%sess", i, min(chunk, tokens - i))
        for i in range(0, tokens, chunk)
    ]


SRC = list(range(0, 13))
DST = [30, 17, 25, 14, 39, 20, 33, 15, 22, 36, 18, 27, 31]  # a paged cache's random order


def kv(side: WorkerSide, blocks: list[int], tokens: int = TOKENS) -> torch.Tensor:
    return gather(side.caches, side.layouts, token_slots(blocks, N, N, 0, tokens))


def store(side: WorkerSide, ps: list[Piece]) -> None:
    side.save(StepPlan(stores=[StoreSpec("s", "sess", ps, SRC)]))
    side.take_sent()
    if side.sidecar is not None:
        side.sidecar.drain()


def load(side: WorkerSide, ps: list[Piece], start: int = 0, end: int = TOKENS) -> set[int]:
    side.load(StepPlan(loads=[LoadSpec("l", start, end, ps, DST)]))
    return side.take_invalid()


@pytest.mark.parametrize("end", [TOKENS, TOKENS - 1, 150])
def test_a_store_and_a_load_through_shared_memory_move_the_kv_exactly(
    sidecar: Sidecar, local_dir: Path, end: int
) -> None:
    side = worker(sidecar, local_dir)
    try:
        ps = pieces("a")
        store(side, ps)
        before = kv(side, DST)
        assert load(side, ps, end=end) == set()
        assert torch.equal(kv(side, DST, end), kv(side, SRC, end))
        # tokens past `end` in the last block are not touched
        after = kv(side, DST)
        assert torch.equal(after[:, :, :, end:], before[:, :, :, end:])
        counts = side.counters.drain()
        assert counts["store_bytes_shm"] > 0 and counts["load_bytes_shm"] > 0
        assert "load_bytes_tcp" not in counts and "store_bytes_tcp" not in counts
        assert counts["loaded_tokens"] == end
    finally:
        side.close()


def test_kv_stored_over_tcp_loads_through_shared_memory(sidecar: Sidecar, local_dir: Path) -> None:
    tcp, shm = worker(sidecar, None), worker(sidecar, local_dir)
    try:
        for cache_tcp, cache_shm in zip(tcp.caches, shm.caches, strict=True):
            cache_shm.copy_(cache_tcp)
        ps = pieces("b")
        store(tcp, ps)
        assert tcp.counters.drain()["store_bytes_tcp"] > 0
        assert load(shm, ps) == set()
        assert torch.equal(kv(shm, DST), kv(tcp, SRC))
        assert shm.counters.drain()["load_bytes_shm"] > 0
    finally:
        tcp.close()
        shm.close()


def test_blocks_in_another_engines_layout_are_a_miss_not_wrong_kv(
    sidecar: Sidecar, local_dir: Path
) -> None:
    flash, other = worker(sidecar, local_dir), worker(sidecar, local_dir, transposed=True)
    try:
        assert flash.copier is not None and other.copier is not None
        assert flash.copier.tag != other.copier.tag
        ps = pieces("c")
        store(flash, ps)
        before = kv(other, DST)
        assert load(other, ps) == set(DST)  # every block reported for recompute
        assert torch.equal(kv(other, DST), before)  # and nothing written
    finally:
        flash.close()
        other.close()


def test_a_copy_that_outlived_its_lease_is_recomputed(
    sidecar: Sidecar, local_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release is what makes a shm load good: a lease ended during the copies (here by
    its timeout; a restart or a dropped connection end it the same way) fails the load."""
    side = worker(sidecar, local_dir)
    try:
        ps = pieces("d")
        store(side, ps)
        assert side.local is not None and sidecar.local is not None
        release = side.local.release
        server = sidecar.local

        def expire_then_release(lease: ReadLease) -> bool:
            server.expire(now=float("inf"))  # the copies are done: the lease ends first
            return release(lease)

        monkeypatch.setattr(side.local, "release", expire_then_release)
        assert load(side, ps) == set(DST)
        assert side.counters.drain()["load_races"] == 1
    finally:
        side.close()


def test_without_a_local_socket_the_connector_uses_tcp_and_says_so(
    sidecar: Sidecar, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm_connector.worker")
    side = worker(sidecar, tmp_path)  # no socket there
    try:
        assert side.local is None
        assert "KV path tcp" in caplog.text
        ps = pieces("e")
        store(side, ps)
        assert load(side, ps) == set()
        assert torch.equal(kv(side, DST), kv(side, SRC))
        assert side.counters.drain()["load_bytes_tcp"] > 0
    finally:
        side.close()


def test_a_local_sidecar_that_starts_after_vllm_is_found_and_its_shared_memory_used(
    local_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a GPU node vLLM and the sidecar start side by side: a worker that found no
    socket at start-up looks for it again (`LOOK_FOR_SOCKET_S`, here at once) and moves
    to shared memory once it is there, without a restart."""
    caplog.set_level(logging.INFO, logger="vllm_connector.worker")
    monkeypatch.setattr(regions, "LOOK_FOR_SOCKET_S", 0.0)
    port = free_port()
    config = ConnectorConfig(sidecar_url=f"lm://127.0.0.1:{port}", local_dir=str(local_dir))
    side = WorkerSide(config, N)
    write = flash_writer_of(N, DIM)
    side.register(caches(), {k: (write, HEADS, DIM) for k in caches()})
    try:
        assert side.enabled and side.local is None
        ps = pieces("g")
        assert load(side, ps) == set(DST)  # no sidecar at all yet: a miss
        assert side.local is None  # (looked for, not there)
        late = Sidecar(SidecarSettings(port=port, memory_bytes=64 << 20, local_dir=local_dir))
        late.start()
        try:
            store(side, ps)
            assert side.local is not None
            assert load(side, ps) == set()
            assert torch.equal(kv(side, DST), kv(side, SRC))
            counts = side.counters.drain()
            assert counts["store_bytes_shm"] > 0 and counts["load_bytes_shm"] > 0
            assert "store_bytes_tcp" not in counts
            assert "socket appeared; KV path shm" in caplog.text
        finally:
            late.stop()
    finally:
        side.close()


def test_a_sidecar_gone_mid_session_is_a_miss_and_a_new_one_is_used_again(
    local_dir: Path,
) -> None:
    first = Sidecar(SidecarSettings(port=0, memory_bytes=64 << 20, local_dir=local_dir)).start()
    side = worker(first, local_dir)
    try:
        ps = pieces("f")
        store(side, ps)
        first.stop()
        assert load(side, ps) == set(DST)  # no sidecar: recompute, no exception
        second = Sidecar(
            SidecarSettings(port=first.port, memory_bytes=64 << 20, local_dir=local_dir)
        ).start()
        try:
            assert load(side, ps) == set(DST)  # the new one has no such blocks: a miss
            store(side, ps)  # the new region is mapped and used
            assert load(side, ps) == set()
            assert torch.equal(kv(side, DST), kv(side, SRC))
        finally:
            second.stop()
    finally:
        side.close()


def test_a_full_region_sends_stores_and_loads_over_tcp_and_counts_them(
    sidecar: Sidecar, local_dir: Path
) -> None:
    """Another engine holds the region in slots it has not committed: the store goes over
    lm:// (counted), the sidecar keeps the blocks in its heap, and the load gets them over
    lm:// too."""
    from sidecar.local_client import LocalClient

    holders = [LocalClient(local_dir), LocalClient(local_dir)]  # half the region each at most
    side = worker(sidecar, local_dir)
    try:
        assert sidecar.arena is not None
        half = sidecar.arena.largest_free() // 2 - 4096
        assert all(h.alloc([half]) is not None for h in holders)
        ps = pieces("g")
        store(side, ps)
        assert load(side, ps) == set()
        assert torch.equal(kv(side, DST), kv(side, SRC))
        counts = side.counters.drain()
        assert counts["region_full"] == 1 and counts["store_bytes_tcp"] > 0
        assert counts["load_bytes_tcp"] > 0  # (a small block may still fit the region)
    finally:
        side.close()
        for h in holders:
            h.close()


def test_a_traced_load_and_store_join_the_requests_trace_with_their_bytes(
    sidecar: Sidecar, local_dir: Path
) -> None:
    """The scheduler hands each load and store the request's `traceparent` (vLLM's
    `trace_headers`): the worker's `ctxcache.kv.load`/`store` spans join that trace with
    the bytes they moved, and the sidecar's spans of the lease and the allocation are their
    children (the `trace` field of the local socket's requests). Untraced: no span."""
    pytest.importorskip("opentelemetry.sdk")  # (the GPU check's machine may lack it)
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ctxcache import tracing

    memory = InMemorySpanExporter()
    tracing.configure("test", exporter=memory)
    side = worker(sidecar, local_dir)
    try:
        trace_id, caller = "ab" * 16, "cd" * 8
        trace = {"traceparent": f"00-{trace_id}-{caller}-01"}
        ps = pieces("traced")
        side.save(StepPlan(stores=[StoreSpec("s", "sess", ps, SRC, trace)]))
        side.load(StepPlan(loads=[LoadSpec("l", 0, TOKENS, ps, DST, trace=trace)]))
        assert side.take_invalid() == set()
        side.load(StepPlan(loads=[LoadSpec("u", 0, TOKENS, ps, DST)]))  # untraced
        spans = memory.get_finished_spans()
        names = sorted(s.name for s in spans)
        assert names == sorted(
            [
                "ctxcache.kv.store",
                "sidecar local alloc",
                "sidecar local commit",
                "ctxcache.kv.load",
                "sidecar local lease",
                "sidecar local release",
            ]
        )
        by_name = {s.name: s for s in spans}
        assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_id}
        load_span, store_span = by_name["ctxcache.kv.load"], by_name["ctxcache.kv.store"]
        assert f"{load_span.parent.span_id:016x}" == caller
        assert f"{store_span.parent.span_id:016x}" == caller
        assert by_name["sidecar local lease"].parent.span_id == load_span.context.span_id
        assert by_name["sidecar local alloc"].parent.span_id == store_span.context.span_id
        moved = load_span.attributes["ctxcache.kv.bytes_shm"]
        lease = by_name["sidecar local lease"]
        assert moved > 0 and lease.attributes["ctxcache.kv.bytes_shm"] == moved
        assert load_span.attributes["ctxcache.kv.loaded_tokens"] == TOKENS
        assert store_span.attributes["ctxcache.kv.bytes_shm"] > 0
    finally:
        side.close()
        tracing.shutdown()


def test_a_shared_memory_store_the_sidecar_did_not_take_is_counted_and_sent_over_lm(
    sidecar: Sidecar, local_dir: Path
) -> None:
    """Its commit stored nothing (the lease ended first): counted as a failed store, never
    as stored, and the blocks go over lm:// instead, so the next load still finds them."""
    side = worker(sidecar, local_dir)
    try:
        assert sidecar.local is not None
        sidecar.local.lease_timeout_s = -1.0  # every lease has ended by its commit
        ps = pieces("f")
        store(side, ps)
        counts = side.counters.drain()
        assert counts["store_failures_shm"] == 1
        assert "store_bytes_shm" not in counts and counts["store_bytes_tcp"] > 0
        assert counts["stored_tokens"] == TOKENS  # once, by the path that stored them
        sidecar.local.lease_timeout_s = 30.0
        assert load(side, ps) == set()
        assert torch.equal(kv(side, DST), kv(side, SRC))
    finally:
        side.close()
