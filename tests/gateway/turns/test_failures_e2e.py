"""A turn longer than the turn lock's TTL keeps its lock (renewed while it runs), and a
streamed `/v1/responses` turn whose worker dies mid-stream ends with `response.failed` and
an `error` event the openai SDK raises — through real gateways, Redis and workers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from benchmarks.lib.process import Process
from tests.gateway.conftest import SDK, Stack, aux_gateway

LOCK_TTL_MS = 600


@pytest.fixture
def short_lock_gateway(stack: Stack) -> Iterator[Process]:
    """A gateway whose turn locks live 0.6 s unless renewed."""
    workers = [f"{w.url}={stack.sidecar_url}" for w in stack.workers]
    g = aux_gateway(
        stack, "short-lock", workers, stack.redis.url, CTX_MANAGER_LOCK_TTL_MS=str(LOCK_TTL_MS)
    )
    try:
        yield g
    finally:
        g.stop()


def renewals(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("ctxcache_gateway_turn_lock_renewals_total "):
            return float(line.split()[1])
    return 0.0


def test_a_turn_longer_than_the_lock_ttl_keeps_its_lock(
    stack: Stack, short_lock_gateway: Process
) -> None:
    headers = {"authorization": "Bearer key-a"}
    with httpx.Client(base_url=short_lock_gateway.url, headers=headers, timeout=120) as http:
        r = http.post("/v1/context", json={"model": "tiny", "prompt": "Once upon a time"})
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        long_turn = {
            "model": "tiny",
            "session_id": sid,
            "prompt": " there was",
            "max_tokens": 1200,  # a few seconds: several lock TTLs
            "ignore_eos": True,
        }
        answer: list[httpx.Response] = []
        t0 = time.monotonic()
        t = threading.Thread(
            target=lambda: answer.append(http.post("/v1/completions", json=long_turn))
        )
        t.start()
        busy: list[dict[str, Any]] = []
        short_turns = 0  # a probe that ran once the long turn had committed and let go
        try:
            # past several TTLs, the session is still locked by the long turn
            while not answer:
                time.sleep(LOCK_TTL_MS / 1000)
                if answer:
                    break
                r = http.post(
                    "/v1/completions",
                    json={"model": "tiny", "session_id": sid, "prompt": " no", "max_tokens": 1},
                )
                if r.status_code == 200:
                    # only after the long turn's commit: its reply may still be on the way
                    short_turns += 1
                    break
                assert r.status_code == 409, f"{time.monotonic() - t0:.1f}s: {r.text}"
                busy.append(r.json()["error"])
        finally:
            t.join(120)
        took = time.monotonic() - t0
        assert took > 3 * LOCK_TTL_MS / 1000, f"the turn took {took:.1f}s: too short to tell"
        assert len(busy) >= 2 and {e["code"] for e in busy} == {"session_busy"}
        assert answer[0].status_code == 200, answer[0].text  # its commit found its lock
        info = http.get(f"/v1/context/{sid}").json()
        assert info["turns"] == 2 + short_turns
        assert renewals(http) >= 3
        # the lock went with the commit: the next turn runs at once, and no renewal follows
        done = renewals(http)
        r = http.post(
            "/v1/completions",
            json={"model": "tiny", "session_id": sid, "prompt": " then", "max_tokens": 1},
        )
        assert r.status_code == 200, r.text
        time.sleep(3 * LOCK_TTL_MS / 1000)
        assert renewals(http) == done


@pytest.fixture
def doomed_worker(stack: Stack) -> Iterator[tuple[Process, Process]]:
    """A worker of its own (killed by the test) and a gateway in front of it alone."""
    worker = stack.worker_proc(9).start()
    g = aux_gateway(stack, "doomed", [f"{worker.url}={stack.sidecar_url}"], stack.redis.url)
    try:
        yield worker, g
    finally:
        g.stop()
        worker.stop()


def test_a_worker_dying_mid_stream_ends_the_response_with_response_failed(
    stack: Stack, doomed_worker: tuple[Process, Process], sdk: SDK
) -> None:
    worker, g = doomed_worker
    client = sdk(url=g.url)
    first = client.responses.create(model="tiny", input="Hello.", max_output_tokens=2)
    sid = "ctx_" + first.id[len("resp_") :][:32]  # the response's session (docs/responses.md)
    http = httpx.Client(base_url=g.url, headers={"authorization": "Bearer key-a"})
    turns = http.get(f"/v1/context/{sid}").json()["turns"]
    stream = client.responses.create(
        model="tiny",
        input="Tell me everything.",
        previous_response_id=first.id,
        max_output_tokens=3500,
        stream=True,
    )
    seen: list[Any] = []
    with pytest.raises(openai.APIError) as raised:
        for event in stream:
            seen.append(event)
            if len([e for e in seen if e.type == "response.output_text.delta"]) == 3:
                worker.kill()
    types = [e.type for e in seen]
    assert types[0] == "response.created" and types[-1] == "response.failed", types
    failed = seen[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "worker stopped" in failed.error.message
    assert failed.output[0].status == "incomplete"  # the text so far, marked incomplete
    assert failed.output[0].content[0].text  # type: ignore[union-attr]
    err = raised.value
    assert err.code == "backend_unavailable" and err.type == "server_error"  # type: ignore[attr-defined]
    # nothing was stored or appended
    r = http.get(f"/v1/responses/{failed.id}")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert http.get(f"/v1/context/{sid}").json()["turns"] == turns
    # once a worker serves again, the chain continues from the first response
    replacement = stack.worker_proc(9, port=worker.port).start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                nxt = client.responses.create(
                    model="tiny", input="Again?", previous_response_id=first.id, max_output_tokens=2
                )
                break
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and time.monotonic() < deadline
                time.sleep(0.5)
        assert nxt.status in ("completed", "incomplete")
        items = client.responses.input_items.list(nxt.id)
        assert [i.content[0].text for i in items.data] == ["Again?"]  # type: ignore[union-attr]
        # appended to the same session (its lock was free): not a fork
        assert http.get(f"/v1/context/{sid}").json()["turns"] == turns + 1
    finally:
        replacement.stop()
        http.close()


def test_an_output_item_of_an_incomplete_response_is_incomplete(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    r = client.responses.create(
        model="tiny", input="Go on.", max_output_tokens=1, extra_body={"ignore_eos": True}
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert r.output[0].status == "incomplete"  # type: ignore[union-attr]
