"""`TurnService.stream`: a session turn's stream relayed from the worker, its turn committed
before the usage chunk, its lock given back when the worker's stream breaks off.

Unit tests with fakes at the boundaries: a worker that answers a scripted SSE stream on a
raw socket, a manager that records the turn's append and release. (The same relay runs
end to end against real processes in completions/test_streams_e2e.py and
completions/test_stream_break_e2e.py.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from cache_manager.protocol import AppendTurn, BeginTurn, SessionInfo, SessionState
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.prompts import PromptBuilder
from gateway.settings import WorkerEndpoint
from gateway.shaping import ChunkShaper, session_ref
from gateway.turn_engine import Generation
from gateway.turn_planning import Turn
from gateway.turns import TurnService
from gateway.upstream import WorkerDown
from gateway.worker_client import WorkerClient
from tests.gateway.rawhttp import CHUNKED_HEAD, chunk, read_request, server

SID = "ctx_" + "b" * 32
HISTORY = [1, 2, 3]


def event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {data}\n\n".encode()


TOKENS = [
    event({"choices": [{"index": 0, "text": "Hel", "token_ids": [7]}]}),
    event({"choices": [{"index": 0, "text": "lo", "token_ids": [8], "finish_reason": "length"}]}),
]
USAGE = event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}})


class Manager:
    """A session of three token ids; records the turn's append and its lock's release."""

    def __init__(self) -> None:
        self.appended: list[AppendTurn] = []
        self.released: list[str] = []

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        info = SessionInfo(
            session_id=session_id,
            tenant=req.tenant,
            model="m",
            kind="completion",
            created=0,
            last_used=0,
            ttl=60,
            expires_at=int(time.time()) + 60,
            turns=1,
            version=1,
            context_tokens=len(HISTORY),
        )
        return SessionState(info=info, tokens=HISTORY, messages=[], lock="lock")

    async def append(self, session_id: str, req: AppendTurn) -> SessionInfo:
        self.appended.append(req)
        return SessionInfo(
            session_id=session_id,
            tenant=req.tenant,
            model="m",
            kind="completion",
            created=0,
            last_used=0,
            ttl=60,
            expires_at=int(time.time()) + 60,
            turns=2,
            version=req.expected_version + 1,
            context_tokens=len(HISTORY) + len(req.tokens),
        )

    async def release(self, session_id: str, tenant: str, lock: str) -> None:
        self.released.append(lock)


Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def planned(manager: Manager, port: int) -> tuple[TurnService, Turn]:
    """A completion turn (its prompt given as ids: no `/tokenize`) planned on a worker that
    answers on `port`."""
    pool = WorkerPool(
        [WorkerEndpoint(id="w0", url=f"http://127.0.0.1:{port}")],
        connect_timeout_s=1,
        request_timeout_s=5,
        health_interval_s=60,
        imbalance_slack=4,
        max_inflight=64,
    )
    worker = pool.workers[0]
    worker.healthy, worker.models = True, {"m": 4096}
    worker.client = WorkerClient(
        f"http://127.0.0.1:{port}", connect_timeout_s=1, request_timeout_s=5
    )
    turns = TurnService(manager, pool, GatewayMetrics(), PromptBuilder())  # type: ignore[arg-type]
    body = {"model": "m", "prompt": [4, 5], "max_tokens": 2, "stream": True}
    turn = await turns.begin("t", SID, "completion", body)
    assert isinstance(turn, Turn)
    return turns, turn


def worker(script: Script) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(CHUNKED_HEAD)
        await script(writer)

    return handler


def chunks_of(sent: list[bytes]) -> list[dict[str, Any]]:
    return [orjson.loads(e[len(b"data: ") :]) for e in sent if e != b"data: [DONE]\n\n"]


async def commit_with(turns: TurnService, turn: Turn) -> Callable[[Generation], Any]:
    async def finish(gen: Generation) -> dict[str, Any]:
        return session_ref(await turns.commit(turn, gen))

    return finish


async def test_the_relay_shapes_the_worker_events_and_commits_before_the_usage_chunk() -> None:
    async def answer(writer: asyncio.StreamWriter) -> None:
        for e in [*TOKENS, USAGE, event("[DONE]")]:
            writer.write(chunk(e))
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    manager = Manager()
    async with server(worker(answer)) as port:
        turns, turn = await planned(manager, port)
        shaper = ChunkShaper("completion", "m", True)
        response = await turns.stream(turn, shaper, True, await commit_with(turns, turn))
        sent = [e async for e in response.events]
        await turns.pool.workers[0].client.aclose()

    assert sent[-1] == b"data: [DONE]\n\n"
    text, usage = chunks_of(sent)[:2], chunks_of(sent)[2]
    assert [c["choices"][0]["text"] for c in text] == ["Hel", "lo"]
    assert [c["choices"][0]["token_ids"] for c in text] == [[7], [8]]
    assert text[1]["choices"][0]["finish_reason"] == "length"
    assert {c["id"] for c in chunks_of(sent)} == {shaper.id}
    # committed before the usage chunk, which carries what the commit returned
    (append,) = manager.appended
    assert append.tokens == [4, 5, 7, 8] and append.lock == "lock" and append.worker == "w0"
    assert usage["usage"]["completion_tokens"] == 2 and usage["choices"] == []
    assert usage["session"]["context_tokens"] == len(HISTORY) + 4
    assert manager.released == []  # (the append released it)
    assert turns.keeper.kept == 0


async def test_a_worker_that_breaks_off_mid_stream_releases_the_turn_and_appends_nothing() -> None:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(chunk(TOKENS[0]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()  # the worker dies mid-answer

    manager = Manager()
    async with server(worker(answer)) as port:
        turns, turn = await planned(manager, port)
        shaper = ChunkShaper("completion", "m", False)
        response = await turns.stream(turn, shaper, True, await commit_with(turns, turn))
        sent: list[bytes] = []
        with pytest.raises(WorkerDown):  # (the response cuts the client's stream: see
            async for e in response.events:  # completions/test_streams.py)
                sent.append(e)
        await turns.pool.workers[0].client.aclose()

    assert [c["choices"][0]["text"] for c in chunks_of(sent)] == ["Hel"]
    assert manager.appended == [] and manager.released == ["lock"]
    assert turns.keeper.kept == 0


class FailingShaper(ChunkShaper):
    """A format that ends badly by itself (as a Responses stream does)."""

    def __init__(self, released: list[str]) -> None:
        super().__init__("completion", "m", False)
        self.released = released
        self.released_at_failure: list[str] | None = None

    def failed(self, exc: Exception) -> bytes:  # type: ignore[override]
        self.released_at_failure = list(self.released)
        return b"event: failed\ndata: " + orjson.dumps(exc.__class__.__name__) + b"\n\n"


async def test_a_format_that_ends_badly_gets_its_last_event_after_the_release() -> None:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(chunk(TOKENS[0]))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    manager = Manager()
    async with server(worker(answer)) as port:
        turns, turn = await planned(manager, port)
        shaper = FailingShaper(manager.released)
        response = await turns.stream(turn, shaper, True, await commit_with(turns, turn))
        sent = [e async for e in response.events]
        await turns.pool.workers[0].client.aclose()

    assert sent[-1] == b'event: failed\ndata: "BackendUnavailable"\n\n'
    assert shaper.released_at_failure == ["lock"]  # given back before the last event
    assert manager.appended == [] and manager.released == ["lock"]
    assert not turns.pool.workers[0].healthy  # marked down: the next turn goes elsewhere


async def test_a_chat_turn_with_tools_keeps_the_tool_call_its_deltas_streamed() -> None:
    """On the engine's chat endpoint a tool call comes in pieces (OpenAI's deltas, by
    `index`): relayed as they come, put together for the history the commit appends."""
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather"}}
    deltas = [
        {"delta": {"role": "assistant", "content": None, "tool_calls": [call]}},
        {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}},
        {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}},
        {"delta": {}, "finish_reason": "tool_calls"},
    ]

    async def answer(writer: asyncio.StreamWriter) -> None:
        for i, d in enumerate(deltas):
            writer.write(chunk(event({"choices": [{"index": 0, "token_ids": [20 + i], **d}]})))
        usage = {"prompt_tokens": len(HISTORY) + 2, "completion_tokens": 4}
        writer.write(chunk(event({"choices": [], "usage": usage})))
        writer.write(chunk(event("[DONE]")) + b"0\r\n\r\n")
        await writer.drain()

    manager = Manager()
    async with server(worker(answer)) as port:
        turns, completion = await planned(manager, port)  # (for its pool and its lock)
        assert completion.state is not None
        state = completion.state.model_copy(
            update={"info": completion.state.info.model_copy(update={"kind": "chat"})}
        )
        new = [{"role": "user", "content": "weather in Oslo?"}]
        turn = dataclasses.replace(
            completion, kind="chat", new_messages=new, state=state, chat_engine=True
        )
        shaper = ChunkShaper("chat", "m", False)
        response = await turns.stream(turn, shaper, False, await commit_with(turns, turn))
        sent = [e async for e in response.events]
        await turns.pool.workers[0].client.aclose()

    relayed = [c["choices"][0]["delta"] for c in chunks_of(sent)]
    assert relayed[0]["role"] == "assistant" and relayed[0]["tool_calls"] == [call]
    assert [d.get("tool_calls", [{}])[0].get("function") for d in relayed[1:3]] == [
        {"arguments": '{"city": '},
        {"arguments": '"Oslo"}'},
    ]
    (append,) = manager.appended
    assert append.tokens == [4, 5, 20, 21, 22, 23]
    user, assistant = append.messages
    assert user == new[0]
    assert assistant == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
