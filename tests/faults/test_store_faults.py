"""Redis stopped, killed or stalled under a running gateway: clean 503s, then recovery
with no restart of anything and no session lost (AOF)."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import pytest

from tests.faults.conftest import REDIS_TIMEOUT_S, Conversation, FaultStack, stopped

log = logging.getLogger(__name__)


def envelope(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    return body["error"]  # type: ignore[no-any-return]


def session_calls(http: httpx.Client, sid: str, *, writes: bool = True) -> list[httpx.Response]:
    turn = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out = [
        http.post("/v1/chat/completions", json={**turn, "session_id": sid}),
        http.get("/v1/context"),
        http.get(f"/v1/context/{sid}"),
        http.get("/ready"),
    ]
    if writes:
        out += [
            http.post("/v1/context", json={"model": "tiny", "prompt": "a new one"}),
            http.patch(f"/v1/context/{sid}", json={"ttl": 900}),
            http.delete(f"/v1/context/{sid}"),
        ]
    return out


def test_redis_killed_gives_store_unavailable_then_recovers(fstack: FaultStack) -> None:
    with fstack.client(timeout=30) as http:  # a hang fails here
        conv = Conversation(http)
        conv.turn("Before the outage?")
        before = conv.info()
        fstack.redis.stop(kill=True)  # SIGKILL: a crash, AOF on disk
        try:
            for r in session_calls(http, conv.session_id):
                envelope(r, 503, "store_unavailable")
            # a request without a session needs no store: it is still served
            plain = http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "no store", "max_tokens": 2}
            )
            assert plain.status_code == 200, plain.text
        finally:
            fstack.redis.start()  # same port, same AOF; the gateway is not restarted
        assert conv.info() == before  # nothing lost, nothing half-written
        conv.turn("After the outage?")
        assert conv.info()["turns"] == before["turns"] + 1


@pytest.mark.slow  # waits out socket timeouts and a lock hand-back, 14 s: docs/testing.md
def test_stalled_redis_is_a_bounded_503_and_leaves_the_session_usable(
    fstack: FaultStack,
) -> None:
    with fstack.client(timeout=30) as http:  # a hang fails here
        conv = Conversation(http)
        conv.turn("Before the stall?")
        before = conv.info()
        with stopped(fstack.redis):  # SIGSTOP: connections open, nothing answers
            t0 = time.monotonic()
            # reads and a turn (a write that times out may still land when Redis
            # resumes: a 503 on PATCH/DELETE/create means "outcome unknown")
            calls = session_calls(http, conv.session_id, writes=False)
            stall_s = (time.monotonic() - t0) / len(calls)
            for r in calls:
                envelope(r, 503, "store_unavailable")
        log.info(
            "stalled Redis: %.2f s per request to answer 503 (redis timeout %.1f s)",
            stall_s,
            REDIS_TIMEOUT_S,
        )
        # The commands sent during the stall run when Redis resumes: the turn's lock is
        # taken for a caller who got a 503 and left. The manager gives it back: the
        # session is usable again in seconds, not after the lock's TTL (120 s).
        question = "After the stall?"
        deadline = time.monotonic() + 15
        while True:
            r = http.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": conv.max_tokens,
                    "temperature": 0,
                    "session_id": conv.session_id,
                },
            )
            if r.status_code != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert text == conv.reference(question)["choices"][0]["message"]["content"]
        after = conv.info()
        assert after["turns"] == before["turns"] + 1
