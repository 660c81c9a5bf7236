"""One lease per step for the shm path's sync loads (issue 47), against a real sidecar.

What a user would notice: three requests loaded in one step cost one `lease` round trip
and no `release` round trip (the release is trusted and rides on the next request), each
request's KV is exact and its span says what it loaded; a shared lease that did not hold
makes every load that read under it a miss; one request whose copy raises is a miss
alone, and the lease goes back at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import vllm_connector.shm_loads as shm_loads_mod
from benchmarks.kvpath.kvpath import flash_writer
from sidecar.local_client import ReadLease
from sidecar.service import Sidecar
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)
from tests.vllm_connector.test_paths import (  # noqa: F401 (the sidecar fixture)
    DIM,
    HEADS,
    N,
    caches,
    kv,
    pieces,
    sidecar,
    worker,
)
from vllm_connector.config import ConnectorConfig
from vllm_connector.plan import LoadSpec, Piece, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.worker import WorkerSide

TOKENS = 96  # two pieces of a 64-token chunk each: a whole one and a partial one
SRCS = [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]
DSTS = [[30, 18, 25, 24, 39, 20], [33, 19, 22, 36, 37, 27], [31, 21, 38, 23, 34, 29]]


def requests(sc: Sidecar, op: str) -> int:
    got = sc.metrics.registry.get_sample_value("ctxcache_sidecar_local_requests_total", {"op": op})
    return int(got or 0)


def stored(side: WorkerSide) -> list[list[Piece]]:
    """Three requests' KV, each from blocks of its own, stored through shared memory."""
    out = []
    for i, src in enumerate(SRCS):
        ps = pieces(f"step{i}-", TOKENS)
        side.save(StepPlan(stores=[StoreSpec(f"s{i}", "sess", ps, src)]))
        out.append(ps)
    side.take_sent()
    return out


def step(side: WorkerSide, stored: list[list[Piece]], traces: list[Any] | None = None) -> set[int]:
    traces = traces or [None] * len(stored)
    loads = [
        LoadSpec(f"r{i}", 0, TOKENS, ps, dst, trace=trace)
        for i, (ps, dst, trace) in enumerate(zip(stored, DSTS, traces, strict=True))
    ]
    side.load(StepPlan(loads=loads))
    return side.take_invalid()


def exact(side: WorkerSide, i: int) -> bool:
    return torch.equal(kv(side, DSTS[i], TOKENS), kv(side, SRCS[i], TOKENS))


def test_a_step_of_three_sync_loads_makes_one_lease_round_trip_and_no_release_round_trip(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
) -> None:
    """And each request's span says what it loaded (with the shared lease's round trip
    annotated on each), the sidecar's span of the one lease is the first request's child."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from ctxcache import tracing

    memory = InMemorySpanExporter()
    tracing.configure("test", exporter=memory)
    side = worker(sidecar, local_dir)
    try:
        assert side.local is not None and sidecar.local is not None
        side.local.flush_after_s = 60.0  # nothing flushed on its own
        ps = stored(side)
        side.counters.drain()
        traces = [{"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"} for i in range(3)]
        leases, releases = requests(sidecar, "lease"), requests(sidecar, "release")
        assert step(side, ps, traces) == set()
        assert requests(sidecar, "lease") == leases + 1
        assert requests(sidecar, "release") == releases  # trusted: no round trip
        assert all(exact(side, i) for i in range(3))
        counts = side.counters.drain()
        assert counts["loads"] == 3 and counts["loaded_tokens"] == 3 * TOKENS
        assert "load_races" not in counts and "load_failures" not in counts
        spans = [s for s in memory.get_finished_spans() if s.name == "ctxcache.kv.load"]
        assert sorted(f"{s.context.trace_id:032x}" for s in spans) == [
            f"{i + 1:032x}" for i in range(3)
        ]
        for s in spans:
            assert s.attributes["ctxcache.kv.loaded_tokens"] == TOKENS
            assert s.attributes["ctxcache.kv.step_loads"] == 3
            assert s.attributes["ctxcache.kv.step_lease_keys"] == 6
            assert s.attributes["ctxcache.kv.step_lease_us"] > 0
            assert s.attributes["ctxcache.kv.bytes_shm"] > 0
        (lease,) = [s for s in memory.get_finished_spans() if s.name == "sidecar local lease"]
        first = next(s for s in spans if s.context.trace_id == 1)
        assert lease.parent is not None and lease.parent.span_id == first.context.span_id
        moved = sum(s.attributes["ctxcache.kv.bytes_shm"] for s in spans)
        assert lease.attributes["ctxcache.kv.bytes_shm"] == moved == counts["load_bytes_shm"]
        assert sidecar.local.leases == 1  # its release is queued...
        side.local.flush()
        assert sidecar.local.leases == 0  # ...and frees the slots when sent
        assert requests(sidecar, "release") == releases + 1
    finally:
        side.close()
        tracing.shutdown()


def test_the_next_steps_lease_carries_the_last_steps_release(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
) -> None:
    side = worker(sidecar, local_dir)
    try:
        assert side.local is not None and sidecar.local is not None
        side.local.flush_after_s = 60.0  # nothing flushed on its own
        ps = stored(side)
        releases = requests(sidecar, "release")
        for _ in range(3):
            assert step(side, ps) == set()
            assert sidecar.local.leases == 1  # the earlier step's lease is gone
        assert requests(sidecar, "release") == releases
        assert sidecar.local.released_batched == 2
        assert all(exact(side, i) for i in range(3))
    finally:
        side.close()
    assert sidecar.local is not None and sidecar.local.leases == 0  # flushed at close


def test_a_step_whose_lease_did_not_hold_is_a_miss_for_every_load(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lease ends between the copies and the release (its timeout, forced): the
    release is not trusted, its answer says no, and all three loads are recomputed."""
    side = worker(sidecar, local_dir)
    try:
        assert side.local is not None and sidecar.local is not None
        ps = stored(side)
        side.counters.drain()
        release, server = side.local.release, sidecar.local

        def expire_then_release(lease: ReadLease, **kw: Any) -> bool:
            server.expire(now=float("inf"))
            return release(lease, **kw)

        monkeypatch.setattr(side.local, "release", expire_then_release)
        assert step(side, ps) == {b for dst in DSTS for b in dst}
        counts = side.counters.drain()
        assert counts["load_races"] == 3 and counts["load_failures"] == 3
        assert counts.get("loaded_tokens", 0) == 0 and "load_bytes_shm" not in counts
        assert side.local.trusted_releases == 0
    finally:
        side.close()


def test_one_load_of_a_step_that_raises_is_a_miss_alone_and_the_lease_goes_back_at_once(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir)
    try:
        assert side.copier is not None and sidecar.local is not None
        ps = stored(side)
        side.counters.drain()
        write = side.copier.write_many
        calls: list[int] = []

        def second_raises(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return write(*args, **kwargs)

        monkeypatch.setattr(side.copier, "write_many", second_raises)
        assert step(side, ps) == set(DSTS[1])
        assert exact(side, 0) and exact(side, 2)
        assert sidecar.local.leases == 0  # released and answered, not queued
        counts = side.counters.drain()
        assert counts["load_errors"] == 1 and counts["load_failures"] == 1
        assert counts["loaded_tokens"] == 2 * TOKENS
    finally:
        side.close()


def test_without_deferred_releases_each_step_waits_for_its_release(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
) -> None:
    config = ConnectorConfig(
        sidecar_url=f"lm://127.0.0.1:{sidecar.port}",
        local_dir=str(local_dir),
        chunk_size=64,
        shm_deferred_release=False,
    )
    side = WorkerSide(config, N)
    cs = caches()
    side.register(cs, {k: (flash_writer(N, DIM), HEADS, DIM) for k in cs})
    try:
        assert sidecar.local is not None and side.enabled
        ps = stored(side)
        leases, releases = requests(sidecar, "lease"), requests(sidecar, "release")
        assert step(side, ps) == set()
        assert requests(sidecar, "lease") == leases + 1
        assert requests(sidecar, "release") == releases + 1
        assert sidecar.local.leases == 0
        assert all(exact(side, i) for i in range(3))
    finally:
        side.close()


def test_a_step_with_more_keys_than_one_lease_holds_takes_more_leases(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm_loads_mod, "_STEP_KEYS", 4)  # two requests' keys per lease
    side = worker(sidecar, local_dir)
    try:
        ps = stored(side)
        leases = requests(sidecar, "lease")
        assert step(side, ps) == set()
        assert requests(sidecar, "lease") == leases + 2
        assert all(exact(side, i) for i in range(3))
    finally:
        side.close()


def test_a_step_lease_answered_with_nonsense_is_a_miss_for_every_load_not_a_failed_step(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir)
    try:
        assert side.local is not None
        ps = stored(side)
        side.counters.drain()

        def nonsense(keys: list[str]) -> ReadLease:
            raise KeyError("blocks")  # (what a reply without `blocks` raises)

        monkeypatch.setattr(side.local, "lease", nonsense)
        assert step(side, ps) == {b for dst in DSTS for b in dst}
        counts = side.counters.drain()
        assert counts["load_errors"] == 3 and counts["load_failures"] == 3
        assert counts["loads"] == 3 and counts.get("loaded_tokens", 0) == 0
    finally:
        side.close()
