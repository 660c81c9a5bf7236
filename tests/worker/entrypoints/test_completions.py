"""`/v1/completions` and `/v1/chat/completions`: shapes, token ids, streaming, reuse."""

from __future__ import annotations

from pathlib import Path

import orjson
import torch
from fastapi.testclient import TestClient

from worker.app import create_app
from worker.settings import WorkerSettings

GREEDY = {"temperature": 0, "ignore_eos": True}
SESSION = {"kv_transfer_params": {"lmcache.tag.s": "sess1"}}


def sse(text: str) -> list[dict | str]:
    out: list[dict | str] = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: ")
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def test_completion_shape_and_token_ids(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        json={"prompt": "def main(argv):", "max_tokens": 5, "return_token_ids": True, **GREEDY},
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 5
    tokens = client.post("/tokenize", json={"prompt": "def main(argv):"}).json()
    assert choice["prompt_token_ids"] == tokens["tokens"]
    text = client.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert choice["text"] == text
    assert body["usage"] == {
        "prompt_tokens": tokens["count"],
        "completion_tokens": 5,
        "total_tokens": tokens["count"] + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_session_turns_report_cached_tokens(client: TestClient) -> None:
    ids = list(range(10, 110))
    first = client.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 8, "return_token_ids": True, **GREEDY, **SESSION},
    )
    out = first.json()["choices"][0]["token_ids"]
    client.app.state.worker.engine.wait_idle()
    history = ids + out
    second = client.post(
        "/v1/completions",
        json={"prompt": [*history, 5, 6, 7], "max_tokens": 4, **GREEDY, **SESSION},
    )
    usage = second.json()["usage"]
    assert usage["prompt_tokens"] == len(history) + 3
    assert usage["prompt_tokens_details"]["cached_tokens"] == (len(history) - 1) // 16 * 16


def test_chat_uses_the_template_and_returns_ids(client: TestClient) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "return_token_ids": True, **GREEDY},
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and len(choice["token_ids"]) == 4
    rendered = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert body["prompt_token_ids"] == rendered
    assert body["usage"]["prompt_tokens"] == len(rendered)
    # the same ids through /v1/completions give the same greedy output
    again = client.post(
        "/v1/completions",
        json={"prompt": rendered, "max_tokens": 4, "return_token_ids": True, **GREEDY},
    ).json()
    assert again["choices"][0]["token_ids"] == choice["token_ids"]


def test_completion_stream_matches_the_plain_answer(client: TestClient) -> None:
    req = {"prompt": "import os\n", "max_tokens": 6, **GREEDY, "return_token_ids": True}
    plain = client.post("/v1/completions", json=req).json()
    r = client.post(
        "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict) and e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    streamed_ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed_ids == plain["choices"][0]["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    usage = events[-2]
    assert isinstance(usage, dict) and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 6


def test_chat_stream_deltas_and_usage(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
            **GREEDY,
        },
    )
    events = sse(r.text)
    first = events[0]
    assert isinstance(first, dict) and first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["usage"]["completion_tokens"] == 5  # type: ignore[index]
    assert events[-1] == "[DONE]"


def test_n_seed_and_stop(client: TestClient) -> None:
    req = {
        "prompt": "class Foo:",
        "max_tokens": 12,
        "n": 3,
        "seed": 42,
        "temperature": 1.0,
        "ignore_eos": True,
    }
    a = client.post("/v1/completions", json=req).json()
    b = client.post("/v1/completions", json=req).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert a["usage"]["completion_tokens"] == 36
    text = a["choices"][0]["text"]
    stop = text.split()[2]  # a word from the middle of the answer
    r = client.post("/v1/completions", json={**req, "n": 1, "stop": [stop]}).json()
    (choice,) = r["choices"]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert text.startswith(choice["text"])


def test_prefill_only_then_reuse(client: TestClient) -> None:
    ids = list(range(200, 264))
    r = client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 0, "n": 2, **SESSION}
    ).json()
    assert [c["text"] for c in r["choices"]] == ["", ""]
    assert r["usage"]["completion_tokens"] == 0
    client.app.state.worker.engine.wait_idle()
    r = client.post(
        "/v1/completions", json={"prompt": [*ids, 9], "max_tokens": 1, **SESSION}
    ).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_models_health_metrics(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 4096
    assert client.get("/health").json() == {"status": "ok"}
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    metrics = client.get("/metrics").text
    assert "ctxcache_worker_prompt_tokens_total" in metrics
    assert "ctxcache_worker_ttft_seconds_count 1.0" in metrics


def test_bfloat16_worker_reuses_kv(tiny_model: Path) -> None:
    settings = WorkerSettings(model=str(tiny_model), chunk_size=32, dtype="bfloat16")
    with TestClient(create_app(settings)) as client:
        ids = list(range(300, 380))
        req = {"prompt": ids, "max_tokens": 4, "return_token_ids": True, **GREEDY}
        first = client.post("/v1/completions", json=req).json()
        out = first["choices"][0]["token_ids"]
        client.app.state.worker.engine.wait_idle()
        second = client.post("/v1/completions", json={**req, "prompt": [*ids, *out, 7]}).json()
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        assert client.app.state.worker.runner.kv_shape.dtype == torch.bfloat16


def test_cache_salt_keeps_prefix_caches_apart(client: TestClient) -> None:
    """vLLM's `cache_salt`: a cached prefix is reused only by requests with the same salt."""
    engine = client.app.state.worker.engine

    def cached(ids: list[int], salt: str | None) -> int:
        body = {"prompt": ids, "max_tokens": 1, **GREEDY}
        if salt is not None:
            body["cache_salt"] = salt
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        engine.wait_idle()
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    ids = list(range(300, 400))
    assert cached(ids, "tenant-a") == 0
    assert cached(ids, "tenant-a") == 96  # 6 blocks of 16, the last token is computed
    assert cached(ids, "tenant-b") == 0
    assert cached(ids, None) == 0
    assert cached(ids, None) == 96
    r = client.post("/v1/completions", json={"prompt": ids, "cache_salt": "", **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
