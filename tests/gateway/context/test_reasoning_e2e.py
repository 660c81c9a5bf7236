"""Reasoning fields on a deployment without a reasoning parser (the built-in workers), end
to end (docs/reasoning.md): the session's rule is kept and shown, thinking asked for is
refused with the session unchanged, thinking turned off runs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.gateway.conftest import Stack


@pytest.fixture
def http(stack: Stack) -> httpx.Client:
    with stack.client() as client:
        yield client  # type: ignore[misc]


def create(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"}], **fields}
    got = http.post("/v1/context", json=body)
    assert got.status_code == 200, got.text
    return http.get(f"/v1/context/{got.json()['session_id']}").json()  # type: ignore[no-any-return]


def refused(got: httpx.Response, param: str) -> None:
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param, got.text


def test_the_rule_is_chosen_at_create_and_shown(http: httpx.Client) -> None:
    assert create(http)["reasoning_history"] == "template"
    assert create(http, reasoning_history="keep")["reasoning_history"] == "keep"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    refused(
        http.post("/v1/context", json={**body, "reasoning_history": "all"}), "reasoning_history"
    )
    refused(http.post("/v1/context", json={**body, "reasoning_effort": "high"}), "reasoning_effort")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        (
            {"chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs.enable_thinking",
        ),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ],
)
def test_thinking_asked_without_a_parser_is_refused_and_changes_nothing(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    before = create(http)
    sid = before["session_id"]
    turn = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused(http.post("/v1/chat/completions", json={**turn, **fields, "session_id": sid}), param)
    after = http.get(f"/v1/context/{sid}").json()
    assert (after["turns"], after["context_tokens"]) == (before["turns"], before["context_tokens"])
    # the same without a session: passed through only once checked
    refused(http.post("/v1/chat/completions", json={**turn, **fields}), param)
    stream = {**turn, **fields, "stream": True}
    refused(http.post("/v1/chat/completions", json=stream), param)


def test_thinking_turned_off_needs_no_parser(http: httpx.Client) -> None:
    sid = create(http)["session_id"]
    turn = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "session_id": sid,
        "reasoning_effort": "none",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    got = http.post("/v1/chat/completions", json=turn)
    assert got.status_code == 200, got.text
    assert http.get(f"/v1/context/{sid}").json()["turns"] == 2
