"""A load or store that raises inside the connector's worker half is a miss, never a failed
vLLM step; loads and stores are ordered after vLLM's compute stream through `compute_done`,
read on vLLM's thread; a region is pinned off the load path. Against a real local sidecar,
with CUDA's failures simulated (a CPU machine: `torch.OutOfMemoryError` raised by the copy,
a `RuntimeError` from a failed registration, a fake event and handle at the copier's API).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import vllm_connector.ordering as ordering_mod
import vllm_connector.regions as regions_mod
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)
from tests.vllm_connector.test_paths import (  # noqa: F401 (the sidecar fixture)
    DST,
    SRC,
    TOKENS,
    N,
    kv,
    pieces,
    sidecar,
    store,
    worker,
)
from vllm_connector.plan import LoadSpec, Piece, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.worker import WorkerSide

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def raising(exc: BaseException) -> Callable[..., Any]:
    def copy(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return copy


def load(side: WorkerSide, ps: list[Piece], rid: str = "l") -> set[int]:
    side.load(StepPlan(loads=[LoadSpec(rid, 0, TOKENS, ps, DST)]))
    return side.take_invalid()


def blocks_from(token: int) -> set[int]:
    return set(DST[token // N :])


def reported(side: WorkerSide, want: set[str], timeout: float = 10.0) -> set[int]:
    """Wait for an async load's report; the blocks it failed."""
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while done != want:
        assert time.monotonic() < deadline, f"only {done} reported"
        done |= side.take_loaded()
        time.sleep(0.005)
    return side.take_invalid()


# -- loads: failures are misses --------------------------------------------------------------
@pytest.mark.parametrize(
    "error",
    [OOM, RuntimeError("CUDA error: cudaHostRegister failed: invalid argument")],
    ids=["cuda-oom", "failed-registration"],
)
def test_a_shared_memory_load_that_raises_is_a_miss_and_its_lease_goes_back(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: BaseException,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm_connector.worker")
    side = worker(sidecar, local_dir)
    try:
        ps = pieces("oom")
        store(side, ps)
        assert side.copier is not None and sidecar.local is not None
        before = kv(side, DST)
        with monkeypatch.context() as m:
            m.setattr(side.copier, "write_many", raising(error))
            assert load(side, ps, "req-oom") == set(DST)  # no exception: every block a miss
        counts = side.counters.drain()
        assert counts["load_errors"] == 1 and counts["load_failures"] == 1
        assert counts.get("loaded_tokens", 0) == 0 and "load_bytes_shm" not in counts
        assert torch.equal(kv(side, DST), before)  # nothing half-written is vouched for
        assert sidecar.local.leases == 0  # the lease was released
        assert "req-oom" in caplog.text and type(error).__name__ in caplog.text
        # the engine goes on: the next load of the same blocks is whole
        assert load(side, ps) == set()
        assert torch.equal(kv(side, DST), kv(side, SRC))
    finally:
        side.close()


def test_a_tcp_load_that_raises_midway_keeps_what_it_wrote(
    sidecar: Sidecar,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pieces written before the failure stay good: only the blocks from the first
    unwritten token are recomputed."""
    side = worker(sidecar, None)
    try:
        ps = pieces("tcp-oom")  # 64-token pieces: the second one fails
        store(side, ps)
        assert side.kv is not None
        write = side.kv.write_2ltd
        calls = []

        def second_fails(*args: Any) -> None:
            calls.append(args)
            if len(calls) == 2:
                raise OOM
            write(*args)

        monkeypatch.setattr(side.kv, "write_2ltd", second_fails)
        assert load(side, ps) == blocks_from(64)
        assert torch.equal(kv(side, DST, 64), kv(side, SRC, 64))
        counts = side.counters.drain()
        assert counts["load_errors"] == 1 and counts["loaded_tokens"] == 64
    finally:
        side.close()


def test_an_async_load_that_raises_is_reported_failed_with_its_blocks(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir, async_loads=True)
    try:
        ps = pieces("async-oom")
        store(side, ps)
        assert side.copier is not None and sidecar.local is not None
        monkeypatch.setattr(side.copier, "write_many", raising(OOM))
        side.load(StepPlan(loads=[LoadSpec("a", 0, TOKENS, ps, DST)]))  # no exception
        assert reported(side, {"a"}) == set(DST)
        counts = side.counters.drain()
        assert counts["load_errors"] == 1 and counts["async_loads"] == 1
        assert sidecar.local.leases == 0
    finally:
        side.close()


def test_a_worker_whose_layout_probe_failed_reports_its_loads_failed_at_once(
    sidecar: Sidecar,  # noqa: F811
) -> None:
    config = worker(sidecar, None).config
    side = WorkerSide(config, N)

    def broken_write(*args: Any) -> None:
        raise RuntimeError("no cache write")

    side.register({"layer.0": torch.zeros(4, 2, N, 64)}, {"layer.0": (broken_write, 2, 32)})
    assert side.off is not None and not side.enabled
    side.load(StepPlan(loads=[LoadSpec("p", 0, TOKENS, pieces("p"), DST)]))
    assert side.take_invalid() == set(DST)  # in the step that planned it
    side.close()


def test_a_step_whose_compute_event_cannot_be_recorded_loads_nothing_and_goes_on(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken CUDA context fails the event: every load of that step is a miss."""
    side = worker(sidecar, local_dir)
    try:
        ps = pieces("no-event")
        store(side, ps)
        monkeypatch.setattr(ordering_mod, "compute_done", raising(RuntimeError("CUDA error")))
        plan = [LoadSpec("x", 0, TOKENS, ps, DST), LoadSpec("y", 0, 32, ps[:1], [5, 6])]
        side.load(StepPlan(loads=plan))
        assert side.take_invalid() == set(DST) | {5, 6}
        counts = side.counters.drain()
        assert counts["load_errors"] == 2 and counts["load_failures"] == 2
        assert sidecar.local is not None and sidecar.local.leases == 0  # nothing leased
    finally:
        side.close()


# -- stores: never raise, the lease ends -----------------------------------------------------
def test_a_shared_memory_store_that_raises_is_dropped_and_its_slots_go_back(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir)
    try:
        assert side.copier is not None and sidecar.local is not None
        monkeypatch.setattr(side.copier, "read_many", raising(OOM))
        ps = pieces("store-oom")
        side.save(StepPlan(stores=[StoreSpec("s", "sess", ps, SRC)]))  # no exception
        assert side.take_sent() == {"s"}  # vLLM frees the blocks
        counts = side.counters.drain()
        assert counts["store_errors"] == 1 and counts["store_drops"] == 1
        assert "stored_blocks" not in counts
        assert sidecar.local.leases == 0  # aborted: the slots are the sidecar's again
    finally:
        side.close()


def test_a_store_whose_copies_cannot_be_waited_for_keeps_its_slots_from_others(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broken CUDA context: whether a copy still writes into the slots is unknown, so they
    are not handed back (the sidecar frees them when this process is gone)."""
    side = worker(sidecar, local_dir)
    try:
        assert side.copier is not None and sidecar.local is not None
        monkeypatch.setattr(side.copier, "read_many", raising(OOM))
        monkeypatch.setattr(side.copier, "wait", raising(RuntimeError("CUDA error")))
        side.save(StepPlan(stores=[StoreSpec("s", "sess", pieces("broken"), SRC)]))
        assert side.take_sent() == {"s"}
        assert side.counters.drain()["store_errors"] == 1
        assert sidecar.local.leases == 1  # the write lease stays open
        side.close()  # a clean close, while this process lives: its lock file stays held
        sidecar.local.expire(now=float("inf"))
        assert sidecar.local.leases == 1  # still kept from others
    finally:
        side.close()


# -- ordering: after vLLM's compute stream, read on vLLM's thread ---------------------------
class FakeHandle:
    """The bounded copier's handle: done once the test says the device is."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.event = object()

    def done(self) -> bool:
        return self.ready.is_set()

    def wait(self) -> None:
        self.ready.wait()


class Recorder:
    """`compute_done` as a fake: the thread and device it was asked on, and its events."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, torch.device]] = []
        self.events: list[object] = []

    def __call__(self, device: torch.device) -> object:
        self.asked.append((threading.current_thread().name, device))
        self.events.append(object())
        return self.events[-1]


def ordering_copier(
    side: WorkerSide, monkeypatch: pytest.MonkeyPatch, handle: FakeHandle
) -> list[tuple[str, str, object]]:
    """Give `side`'s copier the bounded ring's API (`after=`, a handle), recording each
    call's method, thread and event; the copies themselves are today's."""
    assert side.copier is not None
    calls: list[tuple[str, str, object]] = []
    for name in ("write_many", "read_many"):
        real = getattr(side.copier, name)

        def ordered(items: Any, after: Any = None, _real: Any = real, _name: str = name) -> Any:
            calls.append((_name, threading.current_thread().name, after))
            _real(items)
            return handle

        monkeypatch.setattr(side.copier, name, ordered)
    return calls


def test_loads_and_stores_wait_for_the_event_recorded_on_vllms_thread(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir)
    try:
        recorder = Recorder()
        monkeypatch.setattr(ordering_mod, "compute_done", recorder)
        handle = FakeHandle()
        handle.ready.set()
        calls = ordering_copier(side, monkeypatch, handle)
        ps = pieces("ordered")
        store(side, ps)
        assert load(side, ps) == set()
        assert torch.equal(kv(side, DST), kv(side, SRC))
        main = threading.current_thread().name
        assert recorder.asked == [(main, torch.device("cpu"))] * 2  # once per step, here
        store_event, load_event = recorder.events
        assert calls == [("read_many", main, store_event), ("write_many", main, load_event)]
    finally:
        side.close()


def test_an_async_load_carries_the_submitting_steps_event_and_is_reported_when_done(
    sidecar: Sidecar,  # noqa: F811
    local_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    side = worker(sidecar, local_dir, async_loads=True)
    try:
        ps = pieces("async-ordered")
        store(side, ps)
        recorder = Recorder()
        monkeypatch.setattr(ordering_mod, "compute_done", recorder)
        handle = FakeHandle()  # the device has not finished the copies
        calls = ordering_copier(side, monkeypatch, handle)
        side.load(StepPlan(loads=[LoadSpec("a", 0, TOKENS, ps, DST)]))
        # the event is the one recorded on this (vLLM's) thread at submit time, and the
        # loader thread's copies wait for it
        assert recorder.asked == [(threading.current_thread().name, torch.device("cpu"))]
        deadline = time.monotonic() + 10
        while not calls:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        ((method, thread, after),) = calls
        assert method == "write_many" and thread.startswith("ctxcache-load")
        assert after is recorder.events[0]
        # not reported while the copies run on the device
        until = time.monotonic() + 0.3
        while time.monotonic() < until:
            assert side.take_loaded() == set()
            time.sleep(0.01)
        handle.ready.set()
        assert reported(side, {"a"}) == set()
        assert torch.equal(kv(side, DST), kv(side, SRC))
    finally:
        handle.ready.set()
        side.close()


# -- pinning off the load path ---------------------------------------------------------------
def test_a_restarted_sidecars_region_is_pinned_beside_the_loads(
    local_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cudaHostRegister` of a large region takes seconds: loads go on with it unpinned
    while a thread pins it, for the rank's own GPU (its device set first); a region pinned
    is unpinned at close."""
    release = threading.Event()
    pinning: list[tuple[str, torch.Tensor]] = []
    unpinned: list[torch.Tensor] = []

    def slow_register(view: torch.Tensor) -> bool:
        assert devices == [gpu]  # the thread's device is the rank's, set before
        pinning.append((threading.current_thread().name, view))
        release.wait(30)
        return True

    def unregister(view: torch.Tensor) -> bool:
        unpinned.append(view)
        return True

    gpu = torch.device("cuda", 3)  # a tensor-parallel rank's (set_device faked: no GPU)
    devices: list[torch.device] = []
    monkeypatch.setattr(regions_mod, "register_host", slow_register)
    monkeypatch.setattr(regions_mod, "unregister_host", unregister)
    monkeypatch.setattr(regions_mod.torch.cuda, "set_device", devices.append)
    settings = SidecarSettings(port=0, memory_bytes=64 << 20, local_dir=local_dir)
    first = Sidecar(settings).start()
    side = worker(first, local_dir)
    try:
        side.regions.pin = gpu  # as on a GPU (the region mapped at start-up was not)
        first.stop()
        second = Sidecar(settings.model_copy(update={"port": first.port})).start()
        try:
            ps = pieces("pin")
            t0 = time.monotonic()
            store(side, ps)  # maps the new region: its pinning starts, and blocks
            assert load(side, ps) == set()
            assert time.monotonic() - t0 < 10
            assert torch.equal(kv(side, DST), kv(side, SRC))
            assert side.counters.drain()["load_bytes_shm"] > 0
            assert len(pinning) == 1 and pinning[0][0] == "ctxcache-pin"
            assert not release.is_set() and not unpinned  # still pinning, beside the loads
            release.set()
            for thread in side.regions._pinning:
                thread.join(10)
            assert [pinned for _, pinned in side.regions._views.values()] == [True]
            side.close()
            assert len(unpinned) == 1 and unpinned[0] is pinning[0][1]
        finally:
            second.stop()
    finally:
        release.set()
        side.close()


def test_a_region_that_cannot_be_pinned_is_used_unpinned(
    local_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_register(view: torch.Tensor) -> bool:
        raise RuntimeError("cudaHostRegister: out of memory")

    monkeypatch.setattr(regions_mod, "register_host", broken_register)
    settings = SidecarSettings(port=0, memory_bytes=64 << 20, local_dir=local_dir)
    first = Sidecar(settings).start()
    side = worker(first, local_dir)
    try:
        side.regions.pin = torch.device("cpu")  # (no device to set)
        first.stop()
        second = Sidecar(settings.model_copy(update={"port": first.port})).start()
        try:
            ps = pieces("nopin")
            store(side, ps)
            assert load(side, ps) == set()
            assert torch.equal(kv(side, DST), kv(side, SRC))
            for thread in side.regions._pinning:
                thread.join(10)
            assert "copies from it stay pageable" in caplog.text
            assert [pinned for _, pinned in side.regions._views.values()] == [False]
        finally:
            second.stop()
    finally:
        side.close()
