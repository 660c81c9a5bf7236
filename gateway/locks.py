"""Turn locks outlive their turns: each lock a turn holds is renewed while it runs.

The manager takes a lock for `lock_ttl_ms` (short, so that the lock of a gateway that
crashed runs out soon); the turn's holder extends it every third of that while the turn
runs, and stops at its commit or release. A turn cannot hold a lock past
`request_timeout_s` (and a little): a keeper whose turn was somehow never ended stops then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from cache_manager.client import ManagerClient
from ctxcache.errors import CtxError
from ctxcache.logs import bind_session

log = logging.getLogger(__name__)
MARGIN_S = 30.0  # past request_timeout_s: the commit after a turn's last token


class LockKeeper:
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
        self._kept: dict[str, asyncio.Task[None]] = {}

    def keep(self, session_id: str, tenant: str, lock: str, ttl_ms: int | None) -> None:
        """Renew `lock` every ttl/3 until `stop(lock)`."""
        if lock in self._kept or not ttl_ms:
            return
        task = asyncio.get_running_loop().create_task(self._renew(session_id, tenant, lock, ttl_ms))
        self._kept[lock] = task
        task.add_done_callback(lambda _: self._kept.pop(lock, None))

    def stop(self, lock: str | None) -> None:
        if lock is not None and (task := self._kept.pop(lock, None)) is not None:
            task.cancel()

    @property
    def kept(self) -> int:
        return len(self._kept)

    async def _renew(self, session_id: str, tenant: str, lock: str, ttl_ms: int) -> None:
        every = ttl_ms / 3000
        until = time.monotonic() + self.max_hold_s
        with bind_session(session_id):
            while time.monotonic() < until:
                await asyncio.sleep(every)
                try:
                    held = await self.manager.renew(session_id, tenant, lock)
                except CtxError as exc:  # a store outage: try again at the next tick
                    log.warning("turn lock renewal failed: %s", exc.message)
                    continue
                if not held:
                    log.warning("turn lock lost while the turn ran (expired or deleted)")
                    return
                if self.on_renew is not None:
                    self.on_renew()
            log.warning("turn lock held past the request timeout: no longer renewed")

    async def aclose(self) -> None:
        for task in list(self._kept.values()):
            task.cancel()
        self._kept.clear()
