"""The connector's worker half reports every async load, whole or failed (unit level: the
real loads into vLLM's cache are tests/vllm_connector/test_vllm_async_loads.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from vllm_connector.config import ConnectorConfig
from vllm_connector.loads import Job
from vllm_connector.plan import LoadSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.worker import WorkerSide

BLOCK = 128


def side(*, async_loads: bool) -> WorkerSide:
    config = ConnectorConfig(sidecar_url="lm://127.0.0.1:1", async_loads=async_loads)
    return WorkerSide(config, BLOCK)


def spec(rid: str, start: int, end: int, blocks: list[int]) -> LoadSpec:
    return LoadSpec(rid, start, end, pieces=[], block_ids=blocks)


def reported(worker: WorkerSide, want: int, timeout: float = 10.0) -> set[str]:
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(done) < want:
        assert time.monotonic() < deadline, f"only {done} reported"
        done |= worker.take_loaded()
        time.sleep(0.01)
    return done


def test_an_async_load_that_cannot_run_is_reported_at_once_with_its_blocks_failed() -> None:
    worker = side(async_loads=True)  # never registered: no sidecar, nothing can load
    try:
        worker.load(StepPlan(loads=[spec("a", 0, 300, [7, 8, 9]), spec("b", 128, 256, [4, 5])]))
        # in the same step, without the loader thread: vLLM frees or recomputes at once
        assert worker.take_loaded() == {"a", "b"}
        # the failed blocks come with the requests (vLLM asks for them right after)
        assert worker.take_invalid() == {7, 8, 9, 5}
        counts = worker.counters.drain()
        assert "async_loads" not in counts  # none ran beside the step
        assert counts["loads"] == 2  # the dashboard's bytes and seconds per load divide by it
        assert counts["load_failures"] == 2
    finally:
        worker.close()


def test_an_async_load_that_raises_is_reported_failed_not_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker = side(async_loads=True)

    def broken(_: list[Job]) -> set[int]:
        raise OSError("boom")

    # enabled, on a path whose load raises (a KV path never should: the worker still copes)
    monkeypatch.setattr(worker, "tcp", SimpleNamespace(load=broken, close=lambda: None))
    try:
        worker.load(StepPlan(loads=[spec("a", 0, 256, [1, 2])]))
        assert reported(worker, 1) == {"a"}
        assert worker.take_invalid() == {1, 2}
        assert "loading its KV failed" in caplog.text
    finally:
        worker.close()


def test_a_sync_load_reports_its_failed_blocks_in_its_own_step() -> None:
    worker = side(async_loads=False)
    worker.load(StepPlan(loads=[spec("a", 0, 256, [1, 2])]))
    assert worker.take_invalid() == {1, 2}
    assert worker.take_loaded() == set()  # nothing to report: the step had it
    worker.close()
