"""A chat request without a session with OpenAI's `allowed_tools` choice reaches the engine
as vLLM 0.32 takes it (its mode, only the allowed tools), and a bad one is refused before
(docs/agents.md, "allowed_tools"); every other request keeps its bytes. A scripted worker
records what it was sent."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from ctxcache.redis_server import RedisServer
from tests.gateway.scripted import Gateways, ScriptedWorker, answer
from tests.gateway.turns.test_allowed_tools import TOOLS, allowed

ANSWER = {"object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1}}


async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
    w.write(answer(200, orjson.dumps(ANSWER)))


@pytest.fixture(scope="module")
def setup(redis_server: RedisServer) -> Iterator[tuple[str, ScriptedWorker]]:
    worker = ScriptedWorker(reply).start()
    gateways = Gateways()
    url = gateways.start(
        redis_url=redis_server.url,
        workers=[f"http://127.0.0.1:{worker.port}"],
        health_interval_s=0.2,
    )
    yield url, worker
    gateways.close()


def post(url: str, **body: Any) -> httpx.Response:
    doc = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=doc, timeout=10)


@pytest.mark.parametrize("mode", ["auto", "required"])
def test_allowed_tools_reach_the_engine_as_its_mode_and_the_subset(
    setup: tuple[str, ScriptedWorker], mode: str
) -> None:
    url, worker = setup
    r = post(url, tool_choice=allowed(mode, "final_result", "search"))
    assert r.status_code == 200, r.text
    sent = worker.requests[-1]
    assert sent["tool_choice"] == mode and sent["tools"] == [TOOLS[0], TOOLS[2]]


def test_a_bad_allowed_tools_is_refused_before_the_engine(
    setup: tuple[str, ScriptedWorker],
) -> None:
    url, worker = setup
    before = len(worker.requests)
    r = post(url, tool_choice=allowed("auto", "nope"))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert len(worker.requests) == before


def test_other_choices_pass_as_they_are(setup: tuple[str, ScriptedWorker]) -> None:
    url, worker = setup
    named = {"type": "function", "function": {"name": "search"}}
    r = post(url, tool_choice=named)
    assert r.status_code == 200
    assert worker.requests[-1]["tool_choice"] == named and worker.requests[-1]["tools"] == TOOLS
