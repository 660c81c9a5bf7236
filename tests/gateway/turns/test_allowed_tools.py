"""OpenAI's `allowed_tools` tool choice (docs/agents.md, "allowed_tools"): the checks take
its chat and Responses forms and refuse bad ones (400, `param: tool_choice`); a session
turn renders its prompt with all of its tools and sends the engine (vLLM 0.32 has no
`allowed_tools`) the allowed subset and the mode.

The session turn runs against a fake manager and a worker on a raw socket that records
each request (its `/tokenize` and its chat completion)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from cache_manager.protocol import BeginTurn, SessionInfo, SessionState
from ctxcache.errors import InvalidRequest
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.prompts import PromptBuilder
from gateway.responses.items import chat_tool_choice
from gateway.settings import WorkerEndpoint
from gateway.tools import check_agent_fields, engine_tool_choice
from gateway.turn_planning import Turn
from gateway.turns import TurnService
from gateway.worker_client import WorkerClient
from tests.gateway.rawhttp import server

SID = "ctx_" + "c" * 32


def tool(name: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [tool("search"), tool("fetch"), tool("final_result")]
HISTORY = [{"role": "user", "content": "Find it."}]


def allowed(mode: str, *names: str) -> dict[str, Any]:
    """The openai SDK's `ChatCompletionAllowedToolChoiceParam`."""
    entries = [{"type": "function", "function": {"name": n}} for n in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": entries}}


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_allowed_tools_are_accepted(mode: str) -> None:
    check_agent_fields({"tool_choice": allowed(mode, "final_result")}, TOOLS)
    check_agent_fields({"tool_choice": allowed(mode, "search", "fetch")}, TOOLS)


@pytest.mark.parametrize(
    "choice",
    [
        allowed("auto", "nope"),  # not a tool
        allowed("any", "search"),  # an unknown mode
        allowed("required"),  # no tools
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}},
        {"type": "allowed_tools"},
        {"type": "allowed_tools", "mode": "auto", "tools": []},  # Responses' form, on chat
        {**allowed("auto", "search"), "mode": "auto"},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"name": "x"}]}},
        {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["search"]}},
    ],
)
def test_bad_allowed_tools_are_refused_naming_tool_choice(choice: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_agent_fields({"tool_choice": choice}, TOOLS)
    assert err.value.param == "tool_choice"


def test_allowed_tools_without_tools_is_refused() -> None:
    with pytest.raises(InvalidRequest) as err:
        check_agent_fields({"tool_choice": allowed("auto", "search")}, None)
    assert err.value.param == "tool_choice"


def test_the_responses_form_is_chats() -> None:
    responses = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "final_result"}],
    }
    assert chat_tool_choice(responses) == allowed("required", "final_result")
    check_agent_fields({"tool_choice": chat_tool_choice(responses)}, TOOLS)
    other = {**responses, "tools": [{"type": "web_search"}]}
    with pytest.raises(InvalidRequest) as err:
        check_agent_fields({"tool_choice": chat_tool_choice(other)}, TOOLS)
    assert err.value.param == "tool_choice"


def test_what_the_engine_gets() -> None:
    choice, tools = engine_tool_choice(allowed("required", "final_result", "search"), TOOLS)
    assert choice == "required" and tools == [TOOLS[0], TOOLS[2]]  # (in the tools' order)
    assert engine_tool_choice("auto", TOOLS) == ("auto", TOOLS)
    named = {"type": "function", "function": {"name": "search"}}
    assert engine_tool_choice(named, TOOLS) == (named, TOOLS)


def render(body: dict[str, Any]) -> list[int]:
    """A toy template: the tools' names, then each message, then the generation prompt."""
    names = ",".join(t["function"]["name"] for t in body.get("tools") or ())
    text = f"[{names}]" + "".join(f"<{m['role']}>{m.get('content')}</>" for m in body["messages"])
    return list((text + ("<assistant>" if body.get("add_generation_prompt") else "")).encode())


class Manager:
    """A chat session with TOOLS, its history rendered with them."""

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        info = SessionInfo(
            session_id=session_id,
            tenant=req.tenant,
            model="m",
            kind="chat",
            created=0,
            last_used=0,
            ttl=60,
            expires_at=int(time.time()) + 60,
            turns=1,
            version=1,
            context_tokens=10,
            tools=TOOLS,
        )
        tokens = render({"tools": TOOLS, "messages": HISTORY})
        return SessionState(info=info, tokens=tokens, messages=HISTORY, lock="lock")

    async def release(self, session_id: str, tenant: str, lock: str) -> None:
        pass


async def test_a_session_turn_sends_the_engine_the_allowed_subset_and_the_mode() -> None:
    seen: list[tuple[bytes, dict[str, Any]]] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            path, body = head.split(b" ")[1], orjson.loads(await reader.readexactly(length))
            seen.append((path, body))
            if path == b"/tokenize":
                doc: dict[str, Any] = {"tokens": render(body), "max_model_len": 4096}
            else:
                prompt = len(body["kv_transfer_params"]["prompt_token_ids"])
                message = {"role": "assistant", "content": "done"}
                doc = {
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": prompt, "completion_tokens": 1},
                }
            out = orjson.dumps(doc)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
            await writer.drain()

    async with server(handler) as port:
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
        turns = TurnService(Manager(), pool, GatewayMetrics(), PromptBuilder())  # type: ignore[arg-type]
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "Now answer."}],
            "tools": TOOLS,
            "tool_choice": allowed("required", "final_result"),
            "max_tokens": 4,
        }
        turn = await turns.begin("t", SID, "chat", body)
        assert isinstance(turn, Turn)
        await turns.engine.generate(turn)
        await turn.lock.give_back()  # (the turn is not committed here)
        await worker.client.aclose()

    tokenize = [b for p, b in seen if p == b"/tokenize"]
    (engine,) = [b for p, b in seen if p == b"/v1/chat/completions"]
    assert tokenize and all(b["tools"] == TOOLS for b in tokenize)  # rendered with all
    rendered = list(b"[search,fetch,final_result]")
    assert turn.tools == TOOLS and turn.prompt[: len(rendered)] == rendered
    assert engine["tool_choice"] == "required" and engine["tools"] == [TOOLS[2]]
    assert engine["kv_transfer_params"]["prompt_token_ids"] == turn.prompt
