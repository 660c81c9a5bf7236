"""A client that leaves cancels its request end to end, on real processes (gateway, two
built-in workers, sidecar, Redis): the worker stops generating, the turn lock is free at
once, and the session holds nothing of the dropped turn. (The same on the real vLLM:
tests/vllm_connector/test_vllm_e2e.py.)"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import Stack
from tests.gateway.test_errors_e2e import new_session
from tests.utils import metric

LONG = {"model": "tiny", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def running(stack: Stack) -> float:
    """Sequences the workers are generating (their own gauge)."""
    return sum(
        metric(httpx.get(f"{w.url}/metrics").text, "ctxcache_worker_running") for w in stack.workers
    )


def wait_running(stack: Stack, want: float, timeout_s: float = 10.0) -> float:
    """Seconds until the workers run `want` sequences (fails after `timeout_s`)."""
    t0 = time.monotonic()
    while running(stack) != want:
        assert time.monotonic() - t0 < timeout_s, f"workers still run {running(stack)}"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("session", [True, False])
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_cancels_its_request(
    stack: Stack, session: bool, stream: bool
) -> None:
    with stack.client() as a:
        body: dict[str, Any] = {**LONG, "prompt": " go on", "stream": stream}
        if session:
            body["session_id"] = sid = new_session(a)
            before = a.get(f"/v1/context/{sid}").json()
        assert wait_running(stack, 0) >= 0
        cancelled = metric(a.get("/metrics").text, "ctxcache_gateway_cancellations_total")
        if stream:
            with a.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(lines)  # the first token is out: mid-stream
                next(lines)
                assert running(stack) == 1
        else:
            leaving = httpx.Client(base_url=stack.url, headers=a.headers)
            with pytest.raises(httpx.ReadTimeout), leaving:  # hangs up after 1.5 s
                leaving.post("/v1/completions", json=body, timeout=httpx.Timeout(10, read=1.5))
        # the client is gone: the worker stops generating for nobody
        wait_running(stack, 0)
        counted = metric(a.get("/metrics").text, "ctxcache_gateway_cancellations_total")
        assert counted == cancelled + 1
        if not session:
            return
        # the lock is free at once (not after its TTL) and nothing was appended
        t0 = time.monotonic()
        r = a.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": " and", "max_tokens": 2, "session_id": sid},
        )
        assert r.status_code == 200, r.text
        assert time.monotonic() - t0 < 5
        after = a.get(f"/v1/context/{sid}").json()
        assert after["turns"] == before["turns"] + 1  # only the completed turn
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == before["context_tokens"] + 1
        assert after["context_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
