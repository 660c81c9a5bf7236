"""The gateway's Prometheus metrics: requests, TTFT, tokens, live sessions, workers."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import Stack
from tests.utils import metric


def test_metrics_count_turns_tokens_and_sessions(stack: Stack) -> None:
    with stack.client() as a:
        before = httpx.get(f"{stack.url}/metrics").text
        sid = a.post("/v1/context", json={"model": "tiny", "prompt": "word " * 200}).json()[
            "session_id"
        ]
        r = a.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": " more", "max_tokens": 2, "session_id": sid},
        )
        assert r.status_code == 200
        after = httpx.get(f"{stack.url}/metrics").text
    assert metric(after, "ctxcache_live_sessions") >= 1
    assert (
        metric(after, "ctxcache_gateway_cached_tokens_total")
        >= metric(before, "ctxcache_gateway_cached_tokens_total") + 190
    )
    ttft = 'ctxcache_gateway_ttft_seconds_count{mode="session",stream="false"}'
    # the turn (not streamed); not the create, which only prefilled (it has no first token)
    assert metric(after, ttft) >= metric(before, ttft) + 1
    e2e = 'ctxcache_gateway_completion_seconds_count{mode="session"}'
    assert metric(after, e2e) >= metric(before, e2e) + 1
    assert 'route="/v1/completions"' in after and sid not in after  # no ids in labels
    assert metric(after, "ctxcache_gateway_worker_healthy") == 2


def test_ttft_is_labelled_by_whether_the_gateway_saw_the_first_token(stack: Stack) -> None:
    """A streamed answer's first token is timed as it passes; a whole answer is labelled
    stream="false", which the TTFT alert leaves out (a long answer is not a slow start)."""

    def count(text: str, mode: str, stream: str) -> float:
        labels = f'mode="{mode}",stream="{stream}"'
        return metric(text, f"ctxcache_gateway_ttft_seconds_count{{{labels}}}")

    with stack.client() as a:
        sid = a.post("/v1/context", json={"model": "tiny", "prompt": "word " * 50}).json()[
            "session_id"
        ]
        before = httpx.get(f"{stack.url}/metrics").text
        ask = {"model": "tiny", "prompt": " more", "max_tokens": 2, "stream": True}
        for body in ({**ask, "session_id": sid}, ask):
            with a.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                assert b"[DONE]" in b"".join(r.iter_bytes())
        after = httpx.get(f"{stack.url}/metrics").text
    for mode in ("session", "plain"):
        assert count(after, mode, "true") == count(before, mode, "true") + 1, mode
        assert count(after, mode, "false") == count(before, mode, "false"), mode
