"""`LockKeeper` at its unit boundary: a manager that only answers `renew` (the real path,
a turn longer than the lock's TTL keeping its lock, is tests/gateway/turns/test_failures_e2e.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, cast

import pytest

from cache_manager.client import ManagerClient
from ctxcache.errors import StoreUnavailable
from gateway.locks import MARGIN_S, LockKeeper

TTL_MS = 30  # a renewal every 10 ms


class Manager:
    """Answers `renew` with `held` (or raises `error`); `gate`, if set, holds each renewal."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.held = True
        self.error: Exception | None = None
        self.gate: asyncio.Event | None = None

    async def renew(self, session_id: str, tenant: str, lock: str) -> bool:
        self.calls.append((session_id, tenant, lock))
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return self.held


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for `condition` (timers on a busy machine fire late, never early)."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 (a plain condition, no event to wait on)
            await asyncio.sleep(0.005)


def keeper(manager: Manager, **kwargs: Any) -> LockKeeper:
    return LockKeeper(cast(ManagerClient, manager), max_hold_s=60, **kwargs)


async def test_a_lock_is_renewed_every_third_of_its_ttl_until_stopped() -> None:
    manager, renewed = Manager(), []
    k = keeper(manager, on_renew=lambda: renewed.append(1))
    k.keep("s1", "acme", "tok", TTL_MS)
    k.keep("s1", "acme", "tok", TTL_MS)  # (kept already: once is enough)
    await until(lambda: len(manager.calls) >= 3)
    assert set(manager.calls) == {("s1", "acme", "tok")}
    assert len(renewed) == len(manager.calls)
    k.stop("tok")
    done = len(manager.calls)
    await asyncio.sleep(0.05)
    assert len(manager.calls) == done and k.kept == 0


async def test_a_turn_shorter_than_a_third_of_the_ttl_starts_no_task() -> None:
    manager = Manager()
    k = keeper(manager)
    before = len(asyncio.all_tasks())
    k.keep("s1", "acme", "tok", 60_000)
    assert len(asyncio.all_tasks()) == before and k.kept == 1
    k.stop("tok")
    k.stop("tok")  # (stopping twice is harmless)
    k.stop(None)
    assert k.kept == 0 and manager.calls == []


async def test_a_lost_lock_is_no_longer_renewed(caplog: pytest.LogCaptureFixture) -> None:
    manager = Manager()
    manager.held = False
    k = keeper(manager)
    k.keep("s1", "acme", "tok", TTL_MS)
    await until(lambda: k.kept == 0)
    await asyncio.sleep(0.03)
    assert len(manager.calls) == 1
    assert "turn lock lost" in caplog.text


async def test_a_store_outage_is_retried_at_the_next_tick(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, renewed = Manager(), []
    manager.error = StoreUnavailable("redis is down")
    k = keeper(manager, on_renew=lambda: renewed.append(1))
    k.keep("s1", "acme", "tok", TTL_MS)
    await until(lambda: len(manager.calls) >= 2)
    assert renewed == [] and k.kept == 1
    manager.error = None
    await until(lambda: bool(renewed))
    assert k.kept == 1
    k.stop("tok")
    assert "turn lock renewal failed" in caplog.text


async def test_a_stop_during_a_renewal_cancels_it_and_nothing_follows() -> None:
    manager, renewed = Manager(), []
    manager.gate = asyncio.Event()
    k = keeper(manager, on_renew=lambda: renewed.append(1))
    k.keep("s1", "acme", "tok", TTL_MS)
    await until(lambda: len(manager.calls) == 1)  # the first renewal waits at the gate
    k.stop("tok")
    manager.gate.set()
    await asyncio.sleep(0.05)
    assert len(manager.calls) == 1 and renewed == [] and k.kept == 0


async def test_no_lock_is_renewed_past_the_request_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    manager = Manager()
    # held at most 45 ms: the renewals at 10, 20, 30 and 40 ms, then no more
    k = LockKeeper(cast(ManagerClient, manager), max_hold_s=0.045 - MARGIN_S)
    k.keep("s1", "acme", "tok", TTL_MS)
    await until(lambda: k.kept == 0)
    await asyncio.sleep(0.03)
    assert 1 <= len(manager.calls) <= 4
    assert "held past the request timeout" in caplog.text


async def test_aclose_stops_every_lock() -> None:
    manager = Manager()
    k = keeper(manager)
    for n in range(3):
        k.keep(f"s{n}", "acme", f"tok{n}", TTL_MS)
    await k.aclose()
    await asyncio.sleep(0.03)
    assert k.kept == 0 and manager.calls == []
