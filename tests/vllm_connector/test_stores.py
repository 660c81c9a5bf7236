"""Stores through shared memory whose copies still run (on a GPU the model-runner thread
does not wait for them): committed in a later step's `take_sent`, the request's blocks
held until then, and at close waited for. The copier is the real one, its handle a fake
that says when the "device" is done (`FakeHandle`); the sidecar is real.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from sidecar.local_client import LocalClient
from sidecar.service import Sidecar
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)
from tests.vllm_connector.test_paths import (  # noqa: F401 (the sidecar fixture)
    DST,
    SRC,
    kv,
    pieces,
    sidecar,
    worker,
)
from tests.vllm_connector.test_worker_failures import FakeHandle, load, ordering_copier
from vllm_connector.plan import Piece, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.worker import WorkerSide


def present(local_dir: Path, keys: list[str]) -> list[bool]:
    """Which keys the sidecar holds, asked by another engine."""
    probe = LocalClient(local_dir)
    try:
        return probe.exists_many(keys)
    finally:
        probe.close()


def save_pending(
    side: WorkerSide, monkeypatch: pytest.MonkeyPatch, tag: str, handle: FakeHandle
) -> list[Piece]:
    """Store request "s" with copies that run until `handle.ready` is set; its pieces."""
    ordering_copier(side, monkeypatch, handle)
    ps = pieces(tag)
    side.save(StepPlan(stores=[StoreSpec("s", "sess", ps, SRC)]))
    return ps


def test_a_store_whose_copies_run_is_committed_in_a_later_step_and_its_blocks_held_until(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir)
    try:
        handle = FakeHandle()
        ps = save_pending(side, monkeypatch, "pending", handle)
        assert side.take_sent() == set()  # vLLM keeps the blocks: the copies still read them
        assert side.take_sent() == set()
        keys = [side.key(p.key) for p in ps]
        assert present(local_dir, keys) == [False] * len(ps)  # not committed: not readable
        assert "store_bytes_shm" not in side.counters.drain()
        handle.ready.set()  # the device is done
        assert side.take_sent() == {"s"}
        counts = side.counters.drain()
        assert counts["store_bytes_shm"] > 0 and counts["stored_blocks"] == len(ps)
        assert "store_drops" not in counts and "store_bytes_tcp" not in counts
        assert load(side, ps) == set()
        assert torch.equal(kv(side, DST), kv(side, SRC))
    finally:
        side.close()


def test_a_store_still_copying_at_close_is_waited_for_and_committed(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir)
    handle = FakeHandle()
    ps = save_pending(side, monkeypatch, "at-close", handle)
    threading.Timer(0.2, handle.ready.set).start()
    side.close()  # waits for the copies, then commits
    assert side.take_sent() == {"s"}
    assert side.counters.drain()["store_bytes_shm"] > 0
    assert present(local_dir, [side.key(p.key) for p in ps]) == [True] * len(ps)


def test_a_pending_store_the_sidecar_no_longer_takes_goes_over_tcp(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write lease ran out while the copies ran: the commit is refused, and the
    blocks (still held) are PUT over TCP instead."""
    side = worker(sidecar, local_dir)
    try:
        assert sidecar.local is not None
        handle = FakeHandle()
        ps = save_pending(side, monkeypatch, "late", handle)
        sidecar.local.expire(now=float("inf"))
        handle.ready.set()
        assert side.take_sent() == {"s"}
        assert side.sidecar is not None
        side.sidecar.drain()
        counts = side.counters.drain()
        assert counts["store_failures_shm"] == 1 and counts["store_bytes_tcp"] > 0
        assert load(side, ps) == set()
        assert torch.equal(kv(side, DST), kv(side, SRC))
    finally:
        side.close()


def test_a_pending_store_whose_copies_fail_is_dropped_and_its_slots_given_back(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir)
    try:
        assert sidecar.local is not None

        class Failing(FakeHandle):
            def wait(self) -> Any:
                raise RuntimeError("CUDA error: an illegal memory access")

        handle = Failing()
        save_pending(side, monkeypatch, "fails", handle)
        handle.ready.set()
        assert side.take_sent() == {"s"}  # never an exception on vLLM's thread
        counts = side.counters.drain()
        assert counts["store_errors"] == 1 and counts["store_drops"] == 1
        assert sidecar.local.leases == 0  # aborted: the slots are the sidecar's again
    finally:
        side.close()
