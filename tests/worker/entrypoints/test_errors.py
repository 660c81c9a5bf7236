"""Every bad request gets the OpenAI envelope with the right status and code."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.worker.entrypoints.conftest import ClientFactory


def _error(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == code
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": -2}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "logprobs": 2}, None),
        ({"prompt": "x", "presence_penalty": 0.5}, None),
        ({"prompt": "x", "logit_bias": {"5": 10}}, None),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, None),
    ],
)
def test_validation_is_400_not_422(client: TestClient, body: dict, param: str | None) -> None:
    err = _error(client.post("/v1/completions", json=body), 400, "invalid_request")
    assert err["param"] == param


def test_malformed_json(client: TestClient) -> None:
    r = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    _error(r, 400, "invalid_request")


def test_bad_prompts(client: TestClient) -> None:
    _error(client.post("/v1/completions", json={"prompt": [5, 99999]}), 400, "invalid_request")
    _error(client.post("/v1/completions", json={"prompt": []}), 400, "invalid_request")
    _error(client.post("/v1/completions", json={"prompt": ["a", "b"]}), 400, "invalid_request")
    _error(client.post("/v1/completions", json={"prompt": "x", "n": 99}), 400, "invalid_request")
    _error(client.post("/v1/chat/completions", json={"messages": []}), 400, "invalid_request")
    _error(client.post("/tokenize", json={}), 400, "invalid_request")
    _error(client.post("/detokenize", json={"tokens": [-1]}), 400, "invalid_request")
    bad_tag = {"prompt": "x", "kv_transfer_params": {"lmcache.tag.a@b": "1"}}
    _error(client.post("/v1/completions", json=bad_tag), 400, "invalid_request")


def test_context_length_exceeded(client: TestClient) -> None:
    err = _error(
        client.post("/v1/completions", json={"prompt": [5] * 4000, "max_tokens": 100}),
        400,
        "context_length_exceeded",
    )
    assert "4096" in err["message"]
    _error(
        client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": " a" * 4100}]}
        ),
        400,
        "context_length_exceeded",
    )
    ok = client.post("/v1/completions", json={"prompt": [5] * 4000, "max_tokens": 96})
    assert ok.status_code == 200


def test_unknown_model_and_route(client: TestClient) -> None:
    _error(
        client.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"}),
        404,
        "model_not_found",
    )
    _error(client.get("/v1/nothing"), 404, "not_found")
    _error(client.get("/v1/completions"), 405, "method_not_allowed")


def test_full_queue_is_503_at_once(make_client: ClientFactory) -> None:
    client = make_client(max_queue=0)
    _error(client.post("/v1/completions", json={"prompt": "x"}), 503, "backend_unavailable")


def test_attention_sink_window_keeps_first_and_last(make_client: ClientFactory) -> None:
    client = make_client(sink_tokens=4, window_tokens=1000)
    ids = list(range(10, 4010))
    r = client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 200, "return_token_ids": True}
    )
    assert r.status_code == 200
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 1004
    assert body["choices"][0]["prompt_token_ids"] == ids[:4] + ids[-1000:]
