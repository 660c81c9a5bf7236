from __future__ import annotations

import threading

import torch

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
