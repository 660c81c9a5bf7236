"""How the manager tells a session's sidecar to pin, extend or drop the session's KV.

A small interface, so the manager can be tested against a fake and run against the real
sidecar's control API. Calls run in the background and never fail a manager operation:
a sidecar that is down is logged, and the next turn pins again (each turn re-pins with
the new expiry). A drop that fails is not retried: the pin simply runs out at the
session's old expiry and the sidecar drops the blocks itself.
"""

from __future__ import annotations

import abc
import logging

import httpx

from ctxcache.lmcache_keys import session_key
from ctxcache.tasks import BackgroundTasks
from sidecar.control_client import SidecarControl

log = logging.getLogger(__name__)


class SidecarLink(abc.ABC):
    """Pin/extend and drop a session's KV in the sidecar at `url` (its control API)."""

    @abc.abstractmethod
    async def pin(self, url: str, session_id: str, expires_at: int) -> None: ...

    @abc.abstractmethod
    async def drop(self, url: str, session_id: str) -> None: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        pass


class HttpSidecarLink(SidecarLink):
    """The sidecar control API (`sidecar.control_client.SidecarControl`), one shared pool."""

    def __init__(self, *, timeout_s: float = 1.0, token: str | None = None) -> None:
        # calls run after answering, so a burst (hundreds of creates at once) waits for a
        # pooled connection instead of failing: `timeout_s` bounds each call's own I/O only
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, pool=60.0))
        self.token = token

    def _control(self, url: str) -> SidecarControl:
        return SidecarControl(url, self.token, client=self.client)

    async def pin(self, url: str, session_id: str, expires_at: int) -> None:
        await self._control(url).pin(session_key(session_id), expires_at)

    async def drop(self, url: str, session_id: str) -> None:
        await self._control(url).drop(session_key(session_id))

    async def aclose(self) -> None:
        await self.client.aclose()


class NullSidecarLink(SidecarLink):
    """No sidecar configured: nothing to pin."""

    async def pin(self, url: str, session_id: str, expires_at: int) -> None:
        return None

    async def drop(self, url: str, session_id: str) -> None:
        return None


class BackgroundLink:
    """Runs sidecar calls after answering; a failure is logged and retried on the next turn.

    `background` is the manager's one set of after-the-answer work (also its index writes).
    """

    def __init__(self, link: SidecarLink) -> None:
        self.link = link
        self.background = BackgroundTasks(log)

    def pin(self, url: str | None, session_id: str, expires_at: int) -> None:
        if url:
            self.background.spawn(
                self.link.pin(url, session_id, expires_at),
                what=f"sidecar pin at {url} (retried on the next turn)",
                session_id=session_id,
            )

    def drop(self, url: str | None, session_id: str) -> None:
        if url:
            self.background.spawn(
                self.link.drop(url, session_id),
                what=f"sidecar drop at {url} (the pin runs out by itself)",
                session_id=session_id,
            )

    async def aclose(self) -> None:
        await self.background.drain()
        await self.link.aclose()
