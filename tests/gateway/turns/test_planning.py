"""Planning a turn: its `/tokenize` calls run while the manager loads the session.

Unit tests at the manager and worker boundaries (a fake manager, a prompt builder that
answers without HTTP); the same path runs end to end against real processes in
test_sessions_e2e.py and test_errors_e2e.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    SessionInfo,
    SessionState,
    TenantUsage,
)
from ctxcache.errors import SessionNotFound
from gateway.context.service import ContextService
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.prompts import FALLBACK_TURNS, PromptBuilder
from gateway.protocol import ContextCreate
from gateway.recent import RecentHistories
from gateway.settings import GatewaySettings, WorkerEndpoint
from gateway.shaping import ChunkShaper
from gateway.turn_engine import Generation
from gateway.turn_planning import Turn
from gateway.turns import TurnService
from gateway.upstream import WorkerDown
from gateway.worker_client import WorkerClient
from tests.gateway.rawhttp import CHUNKED_HEAD, chunk, read_request, server

SID = "ctx_" + "a" * 32
HISTORY = [1, 2, 3]


def render(messages: list[dict[str, Any]], *, gen: bool = False, cont: bool = False) -> list[int]:
    """A toy chat template: `<role>content</>` per message, `<assistant>` to generate."""
    text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
    if cont:
        text = text[: -len("</>")]
    return list((text + ("<assistant>" if gen else "")).encode())


class Prompts(PromptBuilder):
    """Tokenizes text as its bytes, messages with `render`; `down` workers are unreachable."""

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
        if "messages" in body:
            gen, cont = body["add_generation_prompt"], body.get("continue_final_message", False)
            return render(body["messages"], gen=gen, cont=cont), 4096
        return list(body["prompt"].encode()), 4096


class Manager:
    """`begin` answers only once a tokenize has started: a planner that tokenizes after
    the begin returns never gets there (the test times out)."""

    def __init__(
        self, prompts: Prompts, *, missing: bool = False, kind: str = "completion", version: int = 1
    ) -> None:
        self.prompts = prompts
        self.missing = missing
        self.kind = kind
        self.version = version
        self.released: list[str] = []

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        await self.prompts.called.wait()
        if self.missing:
            raise SessionNotFound()
        chat = self.kind == "chat"
        tokens = render(MESSAGES) if chat else HISTORY
        info = SessionInfo(
            session_id=session_id,
            tenant=req.tenant,
            model="m",
            kind=self.kind,  # type: ignore[arg-type]
            created=0,
            last_used=0,
            ttl=60,
            expires_at=int(time.time()) + 60,
            turns=1,
            version=self.version,
            context_tokens=len(tokens),
            affinity="w1",
        )
        held = req.known_version == self.version  # as the manager: none sent again
        return SessionState(
            info=info,
            tokens=tokens,
            messages=MESSAGES if chat and not held else [],
            lock="lock" if req.lock else None,
        )

    async def release(self, session_id: str, tenant: str, lock: str) -> None:
        self.released.append(lock)

    async def usage(self, tenant: str) -> TenantUsage:  # (a create's quota check) room
        return TenantUsage(
            tenant=tenant, sessions=0, context_tokens=0, max_sessions=1, max_context_tokens=1 << 20
        )


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
LATER = time.time() + 3600
MESSAGES = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi!"}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "and?"}], "max_tokens": 2}


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


async def test_what_is_not_tokenized_early() -> None:
    prompts = Prompts()
    turns = service(prompts, Manager(prompts))
    assert turns.planner._start_early("completion", SID, {"model": "m", "prompt": [5, 6]}) is None
    assert turns.planner._start_early("completion", SID, {"model": "other", "prompt": "x"}) is None
    assert turns.planner._start_early("chat", SID, CHAT) is None  # no history of it here


@pytest.mark.parametrize("same_version", [True, False])
async def test_a_chat_turn_renders_early_from_the_history_seen_last(same_version: bool) -> None:
    prompts = Prompts()
    turns = service(prompts, Manager(prompts, kind="chat", version=3))
    turns.recent.put(SID, 3 if same_version else 2, MESSAGES, LATER)
    turn = await asyncio.wait_for(turns.begin("t", SID, "chat", dict(CHAT)), 5)
    # the whole conversation's rendering, whichever way it was made
    assert turn.prompt == render([*MESSAGES, *CHAT["messages"]], gen=True)  # type: ignore[list-item]
    # early: one rendering while the session loads; a stale version renders once more after
    assert len(prompts.calls) == (1 if same_version else 2)
    assert turn.worker is not None and turn.worker.id == "w1"


async def test_an_early_render_that_failed_falls_back_to_the_held_history() -> None:
    prompts = Prompts(down={"w0"})
    turns = service(prompts, Manager(prompts, kind="chat", version=3))
    turns.pool.workers[1].inflight = 1  # the early render goes to w0, which is down
    turns.recent.put(SID, 3, MESSAGES, LATER)  # so the begin sends no messages
    turn = await asyncio.wait_for(turns.begin("t", SID, "chat", dict(CHAT)), 5)
    assert turn.state is not None and turn.state.messages == []
    assert turn.prompt == render([*MESSAGES, *CHAT["messages"]], gen=True)  # type: ignore[list-item]
    assert turn.history == MESSAGES


async def test_stored_ids_that_are_not_a_prefix_of_the_rendering_stay_the_prefix() -> None:
    """Generated ids that are not their text's own tokenization: the rendering of the
    conversation does not start with them. They stay the truth: the prompt is the stored
    ids, the end of the assistant turn, then what follows the history's own rendering."""
    prompts = Prompts()
    manager = Manager(prompts, kind="chat", version=3)
    turns = service(prompts, manager)
    turns.recent.put(SID, 3, MESSAGES, LATER)
    odd = [*render(MESSAGES, cont=True)[:-1], 7]  # the reply's last id, generated otherwise
    begin = manager.begin

    async def odd_begin(session_id: str, req: BeginTurn) -> SessionState:
        state = await begin(session_id, req)
        return state.model_copy(update={"tokens": odd})

    manager.begin = odd_begin  # type: ignore[method-assign]
    turn = await asyncio.wait_for(turns.begin("t", SID, "chat", dict(CHAT)), 5)
    new_part = render([*MESSAGES, *CHAT["messages"]], gen=True)[len(render(MESSAGES)) :]  # type: ignore[list-item]
    assert turn.prompt == odd + list(b"</>") + new_part
    # the full rendering early, then the history alone and the (once per model) probe
    assert len(prompts.calls) == 4
    # from now on this model's turns render the history alone in parallel, at once
    rendered = await turns.prompts.chat_full(turns.pool.workers[0], "m", MESSAGES, [])
    assert rendered[2] == render(MESSAGES) and len(prompts.calls) == 6
    for _ in range(FALLBACK_TURNS):  # ... until that many turns in a row did not need it
        await turns.prompts.delta(turns.pool.workers[0], "m", [], MESSAGES, rendered)
    assert (await turns.prompts.chat_full(turns.pool.workers[0], "m", MESSAGES, []))[2] is None


@pytest.mark.parametrize("evicted", [False, True])
async def test_a_committed_chat_turn_is_remembered_for_the_next(evicted: bool) -> None:
    prompts = Prompts()
    manager = Manager(prompts, kind="chat", version=3)
    turns = service(prompts, manager)
    turns.recent.put(SID, 3, MESSAGES, LATER)
    turn = await asyncio.wait_for(turns.begin("t", SID, "chat", dict(CHAT)), 5)
    assert turn.state is not None and turn.state.messages == []  # held here: not sent
    if evicted:  # other sessions pushed it out meanwhile: stored again, whole
        turns.recent.drop(SID)

    async def append(session_id: str, req: AppendTurn) -> SessionInfo:
        assert turn.state is not None
        return turn.state.info.model_copy(update={"version": req.expected_version + 1})

    manager.append = append  # type: ignore[attr-defined]
    gen = Generation("fine.", [7, 8], "stop", {"prompt_tokens": 1}, worker=turn.worker)
    await turns.commit(turn, gen)
    reply = {"role": "assistant", "content": "fine."}
    assert turns.recent.get(SID) == (4, [*MESSAGES, *CHAT["messages"], reply])  # type: ignore[list-item]


def test_recent_histories_are_bounded_and_forget_deleted_sessions() -> None:
    recent = RecentHistories(max_sessions=2, max_chars=1000)
    one = [{"role": "user", "content": "x" * 100}]
    recent.put("a", 1, one, LATER)
    recent.put("b", 1, one, LATER)
    assert recent.get("a") == (1, one)  # now the most recent
    recent.put("c", 1, one, LATER)  # over 2 sessions: the least recently used ("b") goes
    assert recent.get("b") is None and len(recent) == 2
    recent.put("a", 2, [{"role": "user", "content": "y" * 800}], LATER)  # replaces a's entry
    assert recent.get("a") == (2, [{"role": "user", "content": "y" * 800}])
    assert recent.get("c") is None  # 864 + 164 chars > 1000: "c" made room
    recent.put("huge", 1, [{"role": "user", "content": "z" * 2000}], LATER)  # never kept
    assert recent.get("huge") is None and recent.get("a") is not None
    more = [{"role": "assistant", "content": "w"}]
    assert not recent.advance("a", 3, more, LATER, after=1)  # "a" is at version 2
    assert recent.advance("a", 3, more, LATER, after=2)
    assert recent.get("a") == (3, [{"role": "user", "content": "y" * 800}, *more])
    recent.drop("a")
    assert recent.get("a") is None and len(recent) == 0


def test_recent_histories_forget_expired_sessions_and_can_keep_none() -> None:
    recent = RecentHistories()
    one = [{"role": "user", "content": "x"}]
    recent.put("old", 1, one, time.time() - 1)  # expired: never returned
    assert recent.get("old") is None and len(recent) == 0
    recent.put("gone", 1, one, time.time() + 0.05)
    time.sleep(0.1)
    recent.put("new", 1, one, LATER)  # storing sweeps the expired entries at the old end
    assert len(recent) == 1 and recent.get("new") == (1, one)
    none = RecentHistories(max_sessions=0)  # CTX_GATEWAY_RECENT_CHAT_SESSIONS=0
    none.put("a", 1, one, LATER)
    assert none.get("a") is None and len(none) == 0


async def test_a_streamed_turn_reads_its_answer_to_the_end_and_keeps_the_connection() -> None:
    """The events end at `[DONE]`, the body just after it: a turn that stopped reading at
    `[DONE]` left the rest unread, so its connection was dropped, and every streamed turn
    opened a new one."""
    connections = 0
    event = b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}\n\n'

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while await read_request(reader):
            writer.write(CHUNKED_HEAD + chunk(event) + chunk(b"data: [DONE]\n\n"))
            await writer.drain()
            await asyncio.sleep(0.01)  # the body's end comes in a read of its own
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    async def on_done(gen: Generation) -> dict[str, Any]:
        assert gen.text == "a"
        return {"session_id": SID}

    prompts = Prompts()
    turns = service(prompts, Manager(prompts))
    async with server(handler) as port:
        worker = turns.pool.workers[0]
        worker.client = WorkerClient(
            f"http://127.0.0.1:{port}", connect_timeout_s=1, request_timeout_s=5
        )
        turn = Turn("completion", "m", "t", [1], [1], [], [], 4096, worker=worker)
        for _ in range(3):
            shaper = ChunkShaper("completion", "m", False)
            response = await turns.stream(turn, shaper, False, on_done)
            sent = [e async for e in response.events]
            assert sent[-1] == shaper.end
        assert connections == 1 and len(worker.client._idle) == 1
        await worker.client.aclose()


class Planned(Exception):
    pass


async def test_a_create_carries_the_configured_priority_and_a_turn_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`create_priority`: a create's prefill asks vLLM's priority scheduler to run after
    (or before) the session turns, which send no priority (docs/vllm.md, "Scheduling")."""
    bodies: list[dict[str, Any]] = []

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            bodies.append(orjson.loads(await read_request(reader)))
            out = {"choices": [{"text": "", "token_ids": [7]}], "usage": {"prompt_tokens": 2}}
            payload = orjson.dumps(out)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload))
            writer.write(payload)
            await writer.drain()

    prompts = Prompts()
    turns = service(prompts, Manager(prompts))
    async with server(worker) as port:
        w = turns.pool.workers[0]
        url = f"http://127.0.0.1:{port}"
        w.client = WorkerClient(url, connect_timeout_s=1, request_timeout_s=5)
        turns.pool.workers[1].healthy = False
        settings = GatewaySettings(create_priority=5)
        contexts = ContextService(None, turns, turns.pool, settings, GatewayMetrics())  # type: ignore[arg-type]
        planned: list[Turn] = []
        generate = turns.engine.generate

        async def capture(turn: Turn) -> Generation:
            planned.append(turn)
            await generate(turn)
            raise Planned  # (stop before the manager's create)

        monkeypatch.setattr(turns.engine, "generate", capture)
        with pytest.raises(Planned):
            await contexts.create("t", ContextCreate(model="m", prompt="hello"), {})
        assert planned[0].priority == 5 and bodies[0]["priority"] == 5
        turn = Turn("completion", "m", "t", [1, 2], [2], [], [], 4096, worker=w)
        await generate(turn)  # a session turn: no priority sent
        assert "priority" not in bodies[1]
        await w.client.aclose()
