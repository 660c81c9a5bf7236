"""Manager fixtures: the real app on a real Redis, reached through the real client."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import pytest

from cache_manager.app import create_app
from cache_manager.client import ManagerClient
from cache_manager.protocol import Idempotency
from cache_manager.settings import ManagerSettings
from cache_manager.sidecar_link import SidecarLink


class FakeSidecarLink(SidecarLink):
    """Records pin/drop calls (the unit boundary; tests/sidecar has the real one)."""

    def __init__(self, *, fail: bool = False) -> None:
        self.calls: list[tuple[str, str, str, int | None]] = []
        self.fail = fail

    async def pin(self, url: str, session_id: str, expires_at: int) -> None:
        self.calls.append(("pin", url, session_id, expires_at))
        if self.fail:
            raise ConnectionError("sidecar down")

    async def drop(self, url: str, session_id: str) -> None:
        self.calls.append(("drop", url, session_id, None))
        if self.fail:
            raise ConnectionError("sidecar down")


ManagerFactory = Callable[..., AbstractAsyncContextManager[ManagerClient]]


@pytest.fixture
def sidecar_link() -> FakeSidecarLink:
    return FakeSidecarLink()


@pytest.fixture
def make_manager(redis_url: str, sidecar_link: FakeSidecarLink) -> ManagerFactory:
    """`async with make_manager(**settings) as client:` an in-process manager."""

    def factory(
        link: SidecarLink | None = None, **overrides: object
    ) -> AbstractAsyncContextManager[ManagerClient]:
        fields: dict[str, object] = {"redis_url": redis_url, "min_ttl": 1, **overrides}
        settings = ManagerSettings(**fields)  # type: ignore[arg-type]
        app = create_app(settings, sidecar_link=link or sidecar_link)
        return ManagerClient.in_process(app)

    return factory


@pytest.fixture
async def manager(make_manager: ManagerFactory) -> AsyncIterator[ManagerClient]:
    async with make_manager() as client:
        yield client


def idem(
    key: str, body: str = "b", answer: dict[str, object] | None = None, ttl_s: int = 60
) -> Idempotency:
    """An Idempotency-Key's record arguments as the gateway sends them: hashes of the key
    and of the body."""
    return Idempotency(
        key=hashlib.sha256(key.encode()).hexdigest()[:32],
        body=hashlib.sha256(body.encode()).hexdigest(),
        ttl_s=ttl_s,
        answer=answer,
    )
