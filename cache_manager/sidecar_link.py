"""How the manager tells a session's sidecar to pin, extend or drop the session's KV.

A small interface, so the manager can be tested against a fake and run against the real
sidecar's control API. Calls run in the background and never fail a manager operation:
a sidecar that is down is logged, and the next turn pins again (each turn re-pins with
the new expiry). A drop that fails is not retried: the pin simply runs out at the
session's old expiry and the sidecar drops the blocks itself.
"""

from __future__ import annotations

import abc
import asyncio
import logging

import httpx

from ctxcache.lmcache_keys import session_key
from ctxcache.logs import bind_session

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
    """The sidecar control API over HTTP: `PUT/DELETE /sessions/{session key}`."""

    def __init__(
        self,
        *,
        timeout_s: float = 1.0,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.client = client or httpx.AsyncClient(timeout=timeout_s, headers=headers)

    async def pin(self, url: str, session_id: str, expires_at: int) -> None:
        r = await self.client.put(
            f"{url.rstrip('/')}/sessions/{session_key(session_id)}", json={"expires_at": expires_at}
        )
        r.raise_for_status()

    async def drop(self, url: str, session_id: str) -> None:
        r = await self.client.delete(f"{url.rstrip('/')}/sessions/{session_key(session_id)}")
        r.raise_for_status()

    async def aclose(self) -> None:
        await self.client.aclose()


class NullSidecarLink(SidecarLink):
    """No sidecar configured: nothing to pin."""

    async def pin(self, url: str, session_id: str, expires_at: int) -> None:
        return None

    async def drop(self, url: str, session_id: str) -> None:
        return None


class BackgroundLink:
    """Runs sidecar calls as background tasks, logs failures, and keeps task references."""

    def __init__(self, link: SidecarLink) -> None:
        self.link = link
        self.tasks: set[asyncio.Task[None]] = set()
        self.failures = 0

    def pin(self, url: str | None, session_id: str, expires_at: int) -> None:
        if url:
            self._spawn("pin", url, session_id, self.link.pin(url, session_id, expires_at))

    def drop(self, url: str | None, session_id: str) -> None:
        if url:
            self._spawn("drop", url, session_id, self.link.drop(url, session_id))

    def _spawn(self, what: str, url: str, session_id: str, call: object) -> None:
        async def run() -> None:
            with bind_session(session_id):
                try:
                    await call  # type: ignore[misc]
                except Exception as exc:  # a sidecar problem never fails the manager
                    self.failures += 1
                    log.warning(
                        "sidecar %s at %s failed: %s (retried on the next turn)", what, url, exc
                    )

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def drain(self) -> None:
        """Wait for the calls in flight (tests, shutdown)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def aclose(self) -> None:
        await self.drain()
        await self.link.aclose()
