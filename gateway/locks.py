"""Turn locks outlive their turns: each lock a turn holds is renewed while it runs.

The manager takes a lock for `lock_ttl_ms` (short, so that the lock of a gateway that
crashed runs out soon); the turn's holder extends it every third of that while the turn
runs, and stops at its commit or release. A turn cannot hold a lock past
`request_timeout_s` (and a little): a keeper whose turn was somehow never ended stops then.

`Held` is one such lock's lifetime (a turn's lock, or an idempotency claim's), handed out
by `TurnService.held`: renewed from the start, given back once if what it guards fails.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from cache_manager.client import ManagerClient
from ctxcache.errors import CtxError
from ctxcache.logs import bind_session
from ctxcache.tasks import BackgroundTasks

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


class Held:
    """One lock held while a turn (or a create's idempotency claim) runs: renewed from the
    start, and ended one of two ways: `done` (the write it guarded took it: a create;
    a commit only `stop`s renewing it, as a failed append still gives it back) or
    `release`, once (given back in the background; `give_back` waits for that, shielded,
    so that the client's next turn finds the session free).

    As an async context manager, a failure inside gives the lock back (`give_back`, or
    `release` if `wait` is false) and lets the error through; leaving it otherwise keeps
    the lock held, for the rest of the turn (a stream, a commit) to end. A `Held` of no
    lock (`lock` None: a turn that locks nothing) does nothing.
    """

    __slots__ = (
        "background",
        "keeper",
        "lock",
        "record",
        "released",
        "releaser",
        "session_id",
        "tenant",
        "wait",
        "what",
    )

    def __init__(
        self,
        keeper: LockKeeper | None,
        background: BackgroundTasks | None,
        session_id: str,
        tenant: str,
        lock: str | None,
        *,
        record: str | None = None,
        what: str = "turn lock release",
        wait: bool = True,
        releaser: Callable[[], Coroutine[Any, Any, Any]] | None = None,
    ) -> None:
        self.keeper, self.background = keeper, background
        self.session_id, self.tenant, self.lock = session_id, tenant, lock
        self.record = record  # an idempotency record the release frees with the lock
        self.what, self.wait = what, wait
        self.releaser = releaser  # how to give it back; None: the manager's `release`
        self.released = False

    async def __aenter__(self) -> Held:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            await self.give_back()

    def stop(self) -> None:
        """No longer renewed: the write it guarded took it (or the manager released it)."""
        if self.keeper is not None:
            self.keeper.stop(self.lock)

    def done(self) -> None:
        """The write it guarded took the lock with it: not renewed, nothing to give back."""
        self.released = True
        self.stop()

    def release(self) -> asyncio.Task[None] | None:
        """Give the lock back in the background (it expires by itself if this fails); only
        the first call does."""
        if self.lock is None or self.released or self.keeper is None or self.background is None:
            return None
        self.released = True
        self.keeper.stop(self.lock)
        manager, sid = self.keeper.manager, self.session_id
        if self.releaser is not None:
            work = self.releaser()
        elif self.record is None:
            work = manager.release(sid, self.tenant, self.lock)
        else:
            work = manager.release(sid, self.tenant, self.lock, record=self.record)
        return self.background.spawn(work, what=self.what, session_id=sid)

    async def give_back(self) -> None:
        """`release`; waited for if `wait` (shielded: a request being cancelled still
        completes it)."""
        task = self.release()
        if task is not None and self.wait:
            await asyncio.shield(task)


NO_LOCK = Held(None, None, "", "", None)  # (a turn that holds none)
