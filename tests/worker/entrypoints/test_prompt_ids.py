"""The built-in worker's chat endpoint takes the prompt as token ids in
`kv_transfer_params.prompt_token_ids`, as vLLM's does (the gateway's agent turns)."""

from __future__ import annotations

from fastapi.testclient import TestClient

MESSAGES = [{"role": "user", "content": "what time is it?"}]


def test_the_ids_are_the_prompt_and_the_messages_are_not_rendered(client: TestClient) -> None:
    rendered = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    plain = client.post("/v1/chat/completions", json=body).json()
    placeholder = [{"role": "user", "content": "not this"}]
    given = {**body, "messages": placeholder, "kv_transfer_params": {"prompt_token_ids": rendered}}
    got = client.post("/v1/chat/completions", json=given).json()
    assert got["prompt_token_ids"] == rendered
    assert got["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


def test_bad_ids_are_a_400(client: TestClient) -> None:
    for ids in ([], [-1], ["a"], "12"):
        body = {"messages": MESSAGES, "kv_transfer_params": {"prompt_token_ids": ids}}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, (ids, r.text)
        assert r.json()["error"]["param"] == "kv_transfer_params.prompt_token_ids"
