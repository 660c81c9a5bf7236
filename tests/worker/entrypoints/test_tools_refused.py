"""The built-in worker refuses tools, a tool_choice and a response_format with a 400 that
names the engine, instead of ignoring them and answering in plain text."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
MESSAGES = [{"role": "user", "content": "what time is it?"}]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [TOOL]}, "tools"),
        ({"tools": [TOOL], "tool_choice": "auto"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
        ),
    ],
)
def test_tools_are_a_400_naming_the_engine(
    client: TestClient, path: str, extra: dict, param: str
) -> None:
    r = client.post(path, json={"messages": MESSAGES, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["type"] == "invalid_request_error"
    assert err["param"] == param
    message = err["message"]
    assert message.startswith(param) and "not supported by the built-in engine" in message
    assert "(ctxcache worker)" in message and "ctxcache serve --engine vllm" in message
    assert ("tool parser" in message) == (param != "response_format")


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tools": []},
        {"tools": None},
        {"tool_choice": "none"},
        {"tools": [], "tool_choice": "none"},
        {"response_format": {"type": "text"}},
    ],
)
def test_no_tools_in_use_is_answered(client: TestClient, extra: dict) -> None:
    chat = client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **extra}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] is not None
    tok = client.post("/tokenize", json={"messages": MESSAGES, **extra})
    assert tok.status_code == 200, tok.text
    assert tok.json()["count"] > 0


def test_a_streamed_request_is_refused_before_the_stream(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "stream": True, "tools": [TOOL]},
    )
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "tools"
