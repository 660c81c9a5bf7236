from __future__ import annotations

import threading
from pathlib import Path

import torch

from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)
from worker.kv.layout import KVShape
from worker.kv.sidecar import SidecarKV, StoreJob


class DownClient:
    calls = 0

    def __init__(self) -> None:
        pass

    def _fail(self, *a: object, **k: object) -> None:
        DownClient.calls += 1
        raise ConnectionError("refused")

    put = get = exists = _fail

    def health(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_failures_open_the_breaker_instead_of_raising() -> None:
    shape = KVShape(1, 1, 4, torch.float32)
    side = SidecarKV(DownClient, shape)
    try:
        assert side.get("k", 16) is None
        assert not side.breaker.closed
        before = DownClient.calls
        assert side.get("k", 16) is None and not side.exists("k")  # skipped, no call made
        assert DownClient.calls == before
        assert not side.submit(StoreJob([("k", torch.zeros(2, 1, 1, 16, 4))], "s"))
        side.breaker.success()
        assert side.submit(StoreJob([("k", torch.zeros(2, 1, 1, 16, 4))], "s"))
        side.drain(5)
        assert not side.breaker.closed  # the failed PUT opened it again
    finally:
        side.close()


class SlowClient:
    """A sidecar that takes PUTs only when told to."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate, self.puts = gate, 0

    def put(self, *a: object, **k: object) -> None:
        self.gate.wait(10)
        self.puts += 1

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass


def test_the_store_queue_is_bounded_in_bytes_and_frees_them_as_puts_land() -> None:
    shape = KVShape(1, 1, 4, torch.float32)
    gate = threading.Event()
    client = SlowClient(gate)
    block = torch.zeros(2, 1, 1, 128, 4)  # 4 KiB
    side = SidecarKV(lambda: client, shape, max_pending=64, max_pending_bytes=12 << 10)
    try:
        # a job's bytes count until its PUTs are sent: three 4 KiB jobs fill 12 KiB
        assert side.submit(StoreJob([("a", block)], "s"))
        assert side.submit(StoreJob([("b", block)], "s"))
        assert side.submit(StoreJob([("c", block)], "s"))
        assert not side.submit(StoreJob([("d", block)], "s"))  # 16 KiB would be over
        assert side.pending_bytes == 12 << 10
        gate.set()
        side.drain(5)
        assert client.puts == 3 and side.pending_bytes == 0
        # one job larger than the whole budget is still taken when nothing is queued
        assert side.submit(StoreJob([("e", torch.zeros(2, 1, 1, 1024, 4))], "s"))
        side.drain(5)
        assert client.puts == 4
    finally:
        side.close()


def test_the_builtin_workers_storer_and_loader_go_through_a_local_sidecars_region(
    local_dir: Path,
) -> None:
    """`kv_client_factory` with the sidecar's local dir: the built-in worker's stores and
    loads are copies through the shared region (counted by the sidecar), not lm:// streams."""
    from sidecar.service import Sidecar
    from sidecar.settings import SidecarSettings
    from worker.kv.sidecar import kv_client_factory, kv_path

    d = str(local_dir)
    sc = Sidecar(SidecarSettings(port=0, memory_bytes=16 << 20, local_dir=local_dir)).start()
    shape = KVShape(2, 2, 8, torch.bfloat16)
    side = SidecarKV(kv_client_factory(f"lm://127.0.0.1:{sc.port}", 2.0, d), shape)
    try:
        assert kv_path(d) == "shm" and kv_path(None) == "tcp"
        kv = torch.randn(2, 2, 2, 32, 8).to(torch.bfloat16)
        assert side.submit(StoreJob([("m@1@0@a@bfloat16@s%x", kv)], "x"))
        side.drain()
        (got,) = side.get_many([("m@1@0@a@bfloat16@s%x", 32)])
        assert got is not None and torch.equal(got, kv)
        local = sc.metrics.local_bytes
        assert local.labels("store")._value.get() == kv.numel() * 2
        assert local.labels("load")._value.get() == kv.numel() * 2
        assert sc.metrics.bytes_in._value.get() == 0  # nothing came over lm://
    finally:
        side.close()
        sc.stop()
