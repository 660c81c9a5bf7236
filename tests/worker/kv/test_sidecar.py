from __future__ import annotations

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
