"""Tool calls on the real vLLM with the tiny preset: `VllmLaunch(tool_call_parser="hermes")`
(what `ctxcache vllm --tool-call-parser auto` picks for a qwen2 model) parses a forced call
out of the preset's output, through the chat template's Hermes tools block, also when the
prompt comes as token ids from vLLM's own `/tokenize` (the gateway's way)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxcache.net import free_port
from ctxcache.vllm_engine import VllmLaunch, default_tool_parser
from tests.utils import VllmProcess, require_vllm
from tests.vllm_connector.conftest import VLLM_TIMEOUT

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT)

# strict: vLLM then holds the arguments to the schema too (without it, to any JSON value)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[str]:
    require_vllm()
    parser = default_tool_parser(str(tiny_model))
    assert parser == "hermes"
    launch = VllmLaunch(
        model=str(tiny_model),
        served_name="tiny",
        port=free_port(),
        tool_call_parser=parser,
        enforce_eager=True,  # starts sooner; the test is about the parser, not speed
    )
    root = tmp_path_factory.mktemp("vllm-tools")
    with VllmProcess(launch, log_path=root / "vllm.log") as proc:
        yield proc.url


def chat(url: str, **body: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": [WEATHER, TIME],
        "temperature": 0,
        "max_tokens": 100,
        "return_token_ids": True,
        **body,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def calls(choice: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"].get("tool_calls") or []
    ]


@pytest.mark.parametrize(
    "tool_choice, finish, names",
    [
        # a named function: OpenAI's (and vLLM's) finish_reason is `stop`
        ({"type": "function", "function": {"name": "get_weather"}}, "stop", {"get_weather"}),
        ("required", "tool_calls", {"get_weather", "get_time"}),
    ],
)
def test_a_forced_call_comes_back_as_tool_calls(
    vllm: str, tool_choice: Any, finish: str, names: set[str]
) -> None:
    choice = chat(vllm, tool_choice=tool_choice)
    assert choice["finish_reason"] == finish
    got = calls(choice)
    assert got and {name for name, _ in got} <= names
    allowed = {"get_weather": [{"city": "Paris"}, {"city": "Rome"}], "get_time": [{}]}
    assert all(args in allowed[name] for name, args in got)  # the schemas held
    assert not choice["message"].get("content")
    # the same prompt as token ids from vLLM's /tokenize: the same answer, token for token
    prompt = tokenize(vllm, MESSAGES, add_generation_prompt=True)
    again = chat(vllm, tool_choice=tool_choice, kv_transfer_params={"prompt_token_ids": prompt})
    assert again["token_ids"] == choice["token_ids"]
    assert calls(again) == got and again["finish_reason"] == finish
    # the answer, sent back as history, renders after the same prompt (append-only)
    answer = {"role": "assistant", "content": None, "tool_calls": choice["message"]["tool_calls"]}
    result = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "sunny"}
    history = tokenize(vllm, [*MESSAGES, answer, result], add_generation_prompt=True)
    assert history[: len(prompt)] == prompt and len(history) > len(prompt)


def tokenize(url: str, messages: list[dict[str, Any]], **body: Any) -> list[int]:
    r = httpx.post(
        f"{url}/tokenize",
        json={"model": "tiny", "messages": messages, "tools": [WEATHER, TIME], **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["tokens"]
