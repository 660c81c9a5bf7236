"""Reasoning input the Responses API refuses, on real processes (the built-in engine, which
has no reasoning parser): each refusal is a 400 naming the parameter, and the chain it
names is left as it was — its session's version and tokens, and its next turn reusing the
whole history. (Reasoning items made and continued: tests/vllm_connector/
test_responses_reasoning_vllm.py, on the thinking preset.)"""

from __future__ import annotations

from typing import Any

import httpx

from tests.gateway.conftest import SDK, Stack
from tests.gateway.responses.test_responses_e2e import GREEDY, INSTRUCTIONS, session_of


def reasoning_of(response_id: str, text: str = "I thought so") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": "rs_" + response_id.removeprefix("resp_"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def test_reasoning_that_does_not_belong_is_refused_and_changes_nothing(
    stack: Stack, sdk: SDK
) -> None:
    client = sdk()
    first = client.responses.create(input="What is kept?", instructions=INSTRUCTIONS, **GREEDY)
    answer = [item.model_dump(exclude_none=True) for item in first.output]
    user = {"role": "user", "content": "What is kept?"}
    forged = reasoning_of(first.id)
    cases: list[tuple[dict[str, Any], str, str]] = [
        # names a stored response of the caller's, which had no reasoning
        ({"input": [user, forged, *answer]}, "input[1]", "not found"),
        ({"input": [user, {**forged, "id": "rs_123"}, *answer]}, "input[1]", "not found"),
        (
            {"input": [user, {**forged, "encrypted_content": "gAAAA"}, *answer]},
            "input[1].encrypted_content",
            "not supported",
        ),
        ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include", "not supported"),
        ({"input": "hi", "reasoning": {"effort": "enormous"}}, "reasoning.effort", "one of"),
        # the built-in engine parses no reasoning: thinking asked of it would be content
        ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning.effort", "parser"),
    ]
    with stack.client() as http:
        before = http.get(f"/v1/context/{session_of(first.id)}").json()
        for extra, param, says in cases:
            for continued in ({}, {"previous_response_id": first.id}):
                body = {**GREEDY, "instructions": INSTRUCTIONS, **extra, **continued}
                got = http.post("/v1/responses", json=body)
                assert got.status_code == 400, (extra, got.text)
                error = got.json()["error"]
                assert error["param"] == param and says in error["message"], error
        # another tenant's response, named by a reasoning item: not found, as an unknown one
        with stack.client("key-b") as other:
            got = other.post("/v1/responses", json={**GREEDY, "input": [user, forged, *answer]})
        assert got.status_code == 400 and got.json()["error"]["param"] == "input[1]", got.text
        after = http.get(f"/v1/context/{session_of(first.id)}").json()
    assert {k: after[k] for k in ("turns", "context_tokens")} == {
        k: before[k] for k in ("turns", "context_tokens")
    }
    nxt = client.responses.create(
        input="And then?", instructions=INSTRUCTIONS, previous_response_id=first.id, **GREEDY
    )
    assert session_of(nxt.id) == session_of(first.id)  # appended: the chain was free
    assert nxt.usage is not None and first.usage is not None
    history = first.usage.input_tokens + first.usage.output_tokens
    assert nxt.usage.input_tokens_details.cached_tokens >= 0.9 * history
    assert nxt.usage.output_tokens_details.reasoning_tokens == 0
    assert [i.type for i in nxt.output] == ["message"]


def test_a_response_without_reasoning_sent_back_whole_is_accepted(stack: Stack) -> None:
    """The whole conversation with the answer's items as they came (no reasoning item: the
    engine gave none), as a stateless client sends it: an ordinary response."""
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        auth = {"authorization": "Bearer key-a"}
        body = {**GREEDY, "input": "What is kept?", "instructions": INSTRUCTIONS}
        first = http.post("/v1/responses", json=body, headers=auth).json()
        items = [{"role": "user", "content": "What is kept?"}, *first["output"]]
        items.append({"role": "user", "content": "And then?"})
        got = http.post("/v1/responses", json={**body, "input": items}, headers=auth)
    assert got.status_code == 200, got.text
    assert got.json()["reasoning"] == {"effort": None, "summary": None}
