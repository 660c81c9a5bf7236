"""Planning a completion turn: its `/tokenize` runs while the manager loads the session.

Unit tests at the manager and worker boundaries (a fake manager, a prompt builder that
answers without HTTP); the same path runs end to end against real processes in
test_sessions_e2e.py and test_errors_e2e.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cache_manager.protocol import BeginTurn, SessionInfo, SessionState
from ctxcache.errors import SessionNotFound
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.prompts import PromptBuilder
from gateway.settings import WorkerEndpoint
from gateway.turns import TurnService
from gateway.upstream import WorkerDown

SID = "ctx_" + "a" * 32
HISTORY = [1, 2, 3]


class Prompts(PromptBuilder):
    """Tokenizes the text as its bytes; `down` workers fail as unreachable."""

    def __init__(self, down: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.down = down
        self.calls: list[str] = []
        self.called = asyncio.Event()

    async def tokenize(self, worker: Worker, body: dict[str, Any]) -> tuple[list[int], int]:
        self.calls.append(worker.id)
        self.called.set()
        await asyncio.sleep(0)
        if worker.id in self.down:
            raise WorkerDown(worker, "connection refused")
        return list(body["prompt"].encode()), 4096


class Manager:
    """`begin` answers only once a tokenize has started: a planner that tokenizes after
    the begin returns never gets there (the test times out)."""

    def __init__(self, prompts: Prompts, *, missing: bool = False) -> None:
        self.prompts = prompts
        self.missing = missing
        self.released: list[str] = []

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        await self.prompts.called.wait()
        if self.missing:
            raise SessionNotFound()
        info = SessionInfo(
            session_id=session_id,
            tenant=req.tenant,
            model="m",
            kind="completion",
            created=0,
            last_used=0,
            ttl=60,
            expires_at=60,
            turns=1,
            version=1,
            context_tokens=len(HISTORY),
            affinity="w1",
        )
        return SessionState(info=info, tokens=HISTORY, lock="lock" if req.lock else None)

    async def release(self, session_id: str, tenant: str, lock: str) -> None:
        self.released.append(lock)


def service(prompts: Prompts, manager: Manager) -> TurnService:
    pool = WorkerPool(
        [WorkerEndpoint(id=f"w{i}", url=f"http://127.0.0.1:{9 + i}") for i in range(2)],
        connect_timeout_s=1,
        request_timeout_s=1,
        health_interval_s=60,
        imbalance_slack=4,
        max_inflight=64,
    )
    for w in pool.workers:
        w.healthy, w.models = True, {"m": 4096}
    return TurnService(manager, pool, GatewayMetrics(), prompts)  # type: ignore[arg-type]


BODY = {"model": "m", "prompt": "hi", "max_tokens": 2}


async def test_tokenize_overlaps_the_session_load() -> None:
    prompts = Prompts()
    turns = service(prompts, Manager(prompts))
    turn = await asyncio.wait_for(turns.begin("t", SID, "completion", dict(BODY)), 5)
    assert turn.prompt == HISTORY + list(b"hi") and turn.new_tokens == list(b"hi")
    assert turn.worker is not None and turn.worker.id == "w1"  # affinity, not the tokenizer
    assert turn.window == 4096 and len(prompts.calls) == 1


async def test_an_early_tokenize_on_a_dead_worker_falls_back() -> None:
    prompts = Prompts(down={"w0"})
    turns = service(prompts, Manager(prompts))
    turns.pool.workers[1].inflight = 1  # the early tokenize goes to the idle w0: down
    turn = await asyncio.wait_for(turns.begin("t", SID, "completion", dict(BODY)), 5)
    assert prompts.calls == ["w0", "w1"]  # tried early on w0, then again on w1
    assert not turns.pool.workers[0].healthy  # marked down by the early call
    assert turn.worker is not None and turn.worker.id == "w1"
    assert turn.prompt == HISTORY + list(b"hi")


async def test_a_failed_begin_leaves_no_task_behind(caplog: pytest.LogCaptureFixture) -> None:
    prompts = Prompts()
    turns = service(prompts, Manager(prompts, missing=True))
    with pytest.raises(SessionNotFound):
        await asyncio.wait_for(turns.begin("t", SID, "completion", dict(BODY)), 5)
    await asyncio.sleep(0.05)
    assert all(t.get_coro().__name__ != "tokenize" for t in asyncio.all_tasks())
    assert "never retrieved" not in caplog.text
    assert sum(w.inflight for w in turns.pool.workers) == 0


async def test_chat_and_token_prompts_are_not_tokenized_early() -> None:
    prompts = Prompts()
    turns = service(prompts, Manager(prompts))
    assert turns._tokenize_early("chat", {"model": "m", "messages": []}) is None
    assert turns._tokenize_early("completion", {"model": "m", "prompt": [5, 6]}) is None
    assert turns._tokenize_early("completion", {"model": "other", "prompt": "x"}) is None
