"""Turn locks outlive their turns: each lock a turn holds is renewed while it runs.

The manager takes a lock for `lock_ttl_ms` (short, so that the lock of a gateway that
crashed runs out soon); the turn's holder extends it every third of that while the turn
runs, and stops at its commit or release. A turn cannot hold a lock past
`request_timeout_s` (and a little): a keeper whose turn was somehow never ended stops then.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from cache_manager.client import ManagerClient
from ctxcache.errors import CtxError
from ctxcache.logs import bind_session

log = logging.getLogger(__name__)
MARGIN_S = 30.0  # past request_timeout_s: the commit after a turn's last token


class LockKeeper:
    """Renews the locks of running turns. A lock costs a timer while its turn runs; a
    renewal task starts only when a renewal is due (most turns end before their first)."""

    def __init__(
        self,
        manager: ManagerClient,
        *,
        max_hold_s: float,
        on_renew: Callable[[], None] | None = None,
    ) -> None:
        self.manager = manager
        self.max_hold_s = max_hold_s + MARGIN_S
        self.on_renew = on_renew
        self._kept: dict[str, _Kept] = {}

    def keep(self, session_id: str, tenant: str, lock: str, ttl_ms: int | None) -> None:
        """Renew `lock` every ttl/3 until `stop(lock)`."""
        if lock in self._kept or not ttl_ms:
            return
        loop = asyncio.get_running_loop()
        kept = _Kept(session_id, tenant, lock, ttl_ms / 3000, loop.time() + self.max_hold_s)
        self._kept[lock] = kept
        self._schedule(kept)

    def stop(self, lock: str | None) -> None:
        if lock is not None and (kept := self._kept.pop(lock, None)) is not None:
            kept.cancel()

    @property
    def kept(self) -> int:
        return len(self._kept)

    def _schedule(self, kept: _Kept) -> None:
        loop = asyncio.get_running_loop()
        if loop.time() + kept.every > kept.until:
            with bind_session(kept.session_id):
                log.warning("turn lock held past the request timeout: no longer renewed")
            self._kept.pop(kept.lock, None)
            return
        kept.timer = loop.call_later(kept.every, self._due, kept)

    def _due(self, kept: _Kept) -> None:
        kept.timer = None
        kept.renewing = asyncio.get_running_loop().create_task(self._renew(kept))

    async def _renew(self, kept: _Kept) -> None:
        with bind_session(kept.session_id):
            try:
                held = await self.manager.renew(kept.session_id, kept.tenant, kept.lock)
            except CtxError as exc:  # a store outage: try again at the next tick
                log.warning("turn lock renewal failed: %s", exc.message)
                held = True
            else:
                if held and self.on_renew is not None:
                    self.on_renew()
            kept.renewing = None
            if self._kept.get(kept.lock) is not kept:
                return  # stopped meanwhile
            if not held:
                log.warning("turn lock lost while the turn ran (expired or deleted)")
                self._kept.pop(kept.lock, None)
                return
            self._schedule(kept)

    async def aclose(self) -> None:
        kept, self._kept = list(self._kept.values()), {}
        for k in kept:
            k.cancel()


@dataclass
class _Kept:
    """One lock being renewed: its next renewal's timer, or the renewal running."""

    session_id: str
    tenant: str
    lock: str
    every: float  # seconds between renewals
    until: float  # (loop time) no renewal after this
    timer: asyncio.TimerHandle | None = None
    renewing: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.renewing is not None:
            self.renewing.cancel()
