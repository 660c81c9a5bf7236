"""How the manager tells a session's sidecar to pin, extend or drop the session's KV.

A small interface, so the manager can be tested against a fake and run against the real
sidecar's control API. Calls run in the background and never fail a manager operation:
a sidecar that is down is logged, and the next turn pins again. A drop that fails is not
retried: the pin simply runs out and the sidecar drops the blocks itself.

A turn slides the session's expiry, so the pin must follow — but not with a call per
turn: a turn pins `headroom` = min(30 s, ttl / 8) past the new expiry, and the turns
after it skip the call while that pin still covers their expiry (an HTTP call to the
sidecar per turn was ~0.9 ms of a turn's 2-3 ms on a 2-core machine). The price: when a
session expires unused, its KV stays pinned up to `headroom` longer (a DELETE still drops
it at once). Creates and TTL changes pin the exact expiry. What a pin covers is remembered
per process, bounded; a pin call that fails is forgotten, so the next turn pins again. A
sidecar that restarted without its pin file (memory tier only) gets the session pinned
again within `headroom` seconds.
"""

from __future__ import annotations

import abc
import logging
from collections import OrderedDict

import httpx

from ctxcache.tasks import BackgroundTasks
from sidecar.control_client import SidecarControl

log = logging.getLogger(__name__)


class SidecarLink(abc.ABC):
    """Pin/extend and drop a session's KV in the sidecar at `url` (its control API).

    `key` is the tag of the session's KV blocks (`SessionInfo.kv_key`): its own session
    key, or the one of the session it was forked from."""

    @abc.abstractmethod
    async def pin(self, url: str, key: str, expires_at: int) -> None: ...

    @abc.abstractmethod
    async def drop(self, url: str, key: str) -> None: ...

    async def held(self, url: str, key: str) -> tuple[int, int] | None:
        """`(tokens, bytes)` of KV the sidecar holds under the key; None if unknown."""
        return None

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

    async def pin(self, url: str, key: str, expires_at: int) -> None:
        await self._control(url).pin(key, expires_at)

    async def drop(self, url: str, key: str) -> None:
        await self._control(url).drop(key)

    async def held(self, url: str, key: str) -> tuple[int, int] | None:
        try:
            info = await self._control(url).info(key)
            return int(info["tokens"]), int(info["bytes"])
        except Exception as exc:  # a cache: unknown, never an error for the caller
            log.warning("sidecar at %s did not say what it holds: %s", url, exc)
            return None

    async def aclose(self) -> None:
        await self.client.aclose()


class NullSidecarLink(SidecarLink):
    """No sidecar configured: nothing to pin."""

    async def pin(self, url: str, key: str, expires_at: int) -> None:
        return None

    async def drop(self, url: str, key: str) -> None:
        return None


HEADROOM_MAX_S = 30
REMEMBERED_PINS = 100_000


def headroom(ttl: int) -> int:
    return min(HEADROOM_MAX_S, ttl // 8)


class BackgroundLink:
    """Runs sidecar calls after answering; a failure is logged and retried on the next turn.

    `background` is the manager's one set of after-the-answer work (also its index writes).
    """

    def __init__(self, link: SidecarLink, *, remember: int = REMEMBERED_PINS) -> None:
        self.link = link
        self.background = BackgroundTasks(log)
        self._remember = remember
        self._pinned: OrderedDict[tuple[str, str], int] = OrderedDict()  # -> pinned until

    def pin(self, url: str | None, kv_key: str, expires_at: int, *, ttl: int | None = None) -> None:
        """Pin the KV tagged `kv_key` at `url` until `expires_at`; with the `ttl` of a turn
        that slid the expiry, until a little later, or not at all while an earlier pin
        covers it (see the module docstring)."""
        if not url:
            return
        key = (url, kv_key)
        if ttl is not None:
            if self._pinned.get(key, 0) >= expires_at:
                self._pinned.move_to_end(key)
                return
            expires_at += headroom(ttl)
        self._pinned[key] = expires_at
        self._pinned.move_to_end(key)
        while len(self._pinned) > self._remember:
            self._pinned.popitem(last=False)

        async def call() -> None:
            try:
                await self.link.pin(url, kv_key, expires_at)
            except Exception:
                if self._pinned.get(key) == expires_at:
                    del self._pinned[key]  # not pinned after all: the next turn pins again
                raise

        self.background.spawn(
            call(), what=f"sidecar pin at {url} (retried on the next turn)", session_id=kv_key
        )

    def drop(self, url: str | None, kv_key: str) -> None:
        if url:
            self._pinned.pop((url, kv_key), None)
            self.background.spawn(
                self.link.drop(url, kv_key),
                what=f"sidecar drop at {url} (the pin runs out by itself)",
                session_id=kv_key,
            )

    async def aclose(self) -> None:
        await self.background.drain()
        await self.link.aclose()
