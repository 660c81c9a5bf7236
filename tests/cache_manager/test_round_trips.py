"""A session turn (get + lock + append + unlock) costs at most 3 Redis round trips."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import AbstractConnection

from cache_manager.client import ManagerClient
from cache_manager.protocol import AppendTurn, BeginTurn, CreateSession


class RoundTrips:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = AbstractConnection.send_packed_command

        async def counting(conn: AbstractConnection, *args: object, **kw: object) -> None:
            self.count += 1  # one write of a command or of a whole pipeline = one round trip
            await original(conn, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)


async def test_a_turn_is_three_round_trips(
    manager: ManagerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = await manager.create(
        CreateSession(tenant="t", model="m", kind="chat", tokens=list(range(1000)))
    )
    # warm up: scripts loaded (the first EVALSHA of a script may need a SCRIPT LOAD)
    state = await manager.begin(info.session_id, BeginTurn(tenant="t"))
    await manager.append(
        info.session_id, AppendTurn(tenant="t", expected_version=1, lock=state.lock, tokens=[1])
    )
    await manager.service.drain()  # the warm-up's background writes
    manager.service._totals.clear()  # measure the full begin first
    rt = RoundTrips(monkeypatch)
    state = await manager.begin(info.session_id, BeginTurn(tenant="t", messages=True))
    assert rt.count == 1  # record + tokens + lock (+ the tenant's usage), pipelined
    await manager.append(
        info.session_id, AppendTurn(tenant="t", expected_version=2, lock=state.lock, tokens=[2, 3])
    )
    assert rt.count == 2  # on the response path: the CAS append (+ unlock + TTL)
    await manager.service.drain()
    assert rt.count == 3  # then, after answering, the tenant index record
    # the tenant's total is now known: the next turn's quota pre-check needs no extra read
    rt.count = 0
    state = await manager.begin(info.session_id, BeginTurn(tenant="t"))
    assert rt.count == 1
    await manager.release(info.session_id, "t", state.lock or "")
    rt.count = 0
    await manager.get(info.session_id, "t")
    assert rt.count == 1
