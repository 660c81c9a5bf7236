"""Every row of the error table, tenant isolation, TTL expiry and KV drop, end to end."""

from __future__ import annotations

import time
from typing import Any

import httpx
import redis

from ctxcache.lmcache_keys import session_key
from ctxcache.net import free_port
from tests.gateway.conftest import Stack, aux_gateway

DOC = " ".join(f"Paragraph {i} explains why the history lives on the server." for i in range(30))


def envelope(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code, body
    return body["error"]


def new_session(http: httpx.Client, **kw: Any) -> str:
    r = http.post("/v1/context", json={"model": "tiny", "prompt": DOC, **kw})
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def turn(http: httpx.Client, sid: str, **kw: Any) -> httpx.Response:
    return http.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": " and", "max_tokens": 2, "session_id": sid, **kw},
    )


def test_session_not_found_is_one_answer_for_every_case(stack: Stack) -> None:
    with stack.client() as a, stack.client("key-b") as b:
        deleted = new_session(a)
        assert a.delete(f"/v1/context/{deleted}").json() == {
            "session_id": deleted,
            "object": "context.deleted",
            "deleted": True,
            "status": "success",
        }
        expired = new_session(a, ttl=1)
        other = new_session(b)
        time.sleep(1.3)
        bodies = []
        for sid in ("ctx_" + "x" * 32, deleted, expired, other, "nope", "../../etc/passwd"):
            err = envelope(turn(a, sid), 404, "session_not_found")
            bodies.append((err["message"], err["type"]))
            if "/" not in sid:  # a path-like id is simply not a context URL: 404 not_found
                envelope(a.get(f"/v1/context/{sid}"), 404, "session_not_found")
        assert len(set(bodies)) == 1  # ids cannot be probed


def test_tenant_isolation_on_every_endpoint(stack: Stack) -> None:
    with stack.client() as a, stack.client("key-b") as b:
        sid = new_session(a)
        before = a.get(f"/v1/context/{sid}").json()
        envelope(b.get(f"/v1/context/{sid}"), 404, "session_not_found")
        envelope(b.patch(f"/v1/context/{sid}", json={"ttl": 900}), 404, "session_not_found")
        envelope(b.delete(f"/v1/context/{sid}"), 404, "session_not_found")
        envelope(turn(b, sid), 404, "session_not_found")
        envelope(
            b.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "hi"}],
                    "session_id": sid,
                },
            ),
            404,
            "session_not_found",
        )
        assert sid not in {c["session_id"] for c in b.get("/v1/context").json()["data"]}
        assert sid in {c["session_id"] for c in a.get("/v1/context").json()["data"]}
        # all but what the sidecar holds, which may still be filling from the create's prefill
        after = a.get(f"/v1/context/{sid}").json()
        assert _without_kv(after) == _without_kv(before)


def _without_kv(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if k not in ("kv_tokens", "kv_bytes")}


def test_bad_requests_are_400_envelopes_never_422(stack: Stack) -> None:
    with stack.client() as a:
        sid = new_session(a)
        envelope(a.post("/v1/context", content=b"{nope"), 400, "invalid_request")
        envelope(a.post("/v1/context", json={"model": "tiny"}), 400, "invalid_request")
        envelope(
            a.post("/v1/context", json={"model": "tiny", "prompt": "x", "ttl": 10**9}),
            400,
            "invalid_ttl",
        )
        envelope(
            a.post("/v1/context", json={"model": "tiny", "prompt": "x", "ttl": "soon"}),
            400,
            "invalid_ttl",
        )
        envelope(a.patch(f"/v1/context/{sid}", json={"ttl": 0}), 400, "invalid_ttl")
        envelope(a.post("/v1/completions", json={"model": "tiny"}), 400, "invalid_request")
        envelope(a.post("/v1/completions", json=[1, 2]), 400, "invalid_request")
        envelope(turn(a, sid, n=3), 400, "invalid_request")
        envelope(
            a.post("/v1/completions", json={"model": "other", "prompt": "x", "session_id": sid}),
            400,
            "session_model_mismatch",
        )
        envelope(
            a.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model_not_found"
        )
        envelope(
            a.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "x"}],
                    "session_id": sid,
                },
            ),
            400,
            "invalid_request",
        )  # a completion session
        envelope(turn(a, sid, max_tokens=5000), 400, "context_length_exceeded")
        envelope(
            a.post("/v1/completions", json={"model": "tiny", "prompt": "x" * (9 << 20)}),
            413,
            "request_too_large",
        )
        after = a.get(f"/v1/context/{sid}").json()
        assert after["turns"] == 1  # nothing above changed the session


def test_auth(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url) as anon:
        envelope(anon.get("/v1/context"), 401, "invalid_api_key")
        envelope(
            anon.post("/v1/completions", json={"model": "tiny", "prompt": "x"}),
            401,
            "invalid_api_key",
        )
        envelope(
            anon.get("/v1/context", headers={"authorization": "Bearer key-a x"}),
            401,
            "invalid_api_key",
        )
        envelope(
            anon.get("/v1/context", headers={"authorization": "Basic key-a"}),
            401,
            "invalid_api_key",
        )


def test_quota_exceeded(stack: Stack) -> None:
    with stack.client("key-c") as c:
        first = new_session(c)
        envelope(
            c.post("/v1/context", json={"model": "tiny", "prompt": "x"}), 429, "quota_exceeded"
        )
        c.delete(f"/v1/context/{first}")
        c.delete(f"/v1/context/{new_session(c)}")


def test_a_create_the_quota_cannot_keep_is_refused_before_any_inference(stack: Stack) -> None:
    """A streamed create (a context, a response) over the tenant's session quota, or whose
    prompt alone passes its token quota, is a 429 up front: not an answer streamed and then
    cut when the session cannot be written."""
    ask = {"model": "tiny", "max_tokens": 4, "stream": True}
    with stack.client("key-c") as c, stack.client("key-d") as d:
        first = new_session(c)
        try:
            err = envelope(
                c.post("/v1/context", json={**ask, "prompt": "x"}), 429, "quota_exceeded"
            )
            assert "live sessions" in err["message"]
            response = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": True}
            envelope(c.post("/v1/responses", json=response), 429, "quota_exceeded")
            assert [s["session_id"] for s in c.get("/v1/context").json()["data"]] == [first]
        finally:
            c.delete(f"/v1/context/{first}")

        err = envelope(d.post("/v1/context", json={**ask, "prompt": DOC}), 429, "quota_exceeded")
        assert "token" in err["message"]
        assert d.get("/v1/context").json()["data"] == []
        small = d.post("/v1/context", json={**ask, "prompt": "x"})  # what fits is created
        assert small.status_code == 200 and small.headers["content-type"].startswith(
            "text/event-stream"
        )
        d.delete(f"/v1/context/{small.headers['x-session-id']}")


def test_session_busy_while_a_turn_streams(stack: Stack) -> None:
    with stack.client() as a, stack.client() as a2:
        sid = new_session(a)
        with a.stream(
            "POST",
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": " go",
                "max_tokens": 1000,  # seconds: the refusals below take well under one
                "stream": True,
                "session_id": sid,
                "ignore_eos": True,
            },
        ) as r:
            lines = r.iter_lines()
            next(lines)
            err = envelope(turn(a2, sid), 409, "session_busy")
            assert err["type"]
            busy = turn(a2, sid)
            assert busy.status_code == 409, busy.text
            assert int(busy.headers["retry-after-ms"]) > 0
            # a read-only turn (session_append: false) is not blocked
            assert turn(a2, sid, session_append=False).status_code == 200
            assert list(lines)[-2] == "data: [DONE]"
        assert turn(a, sid).status_code == 200


def test_client_disconnect_mid_stream_leaves_session_unchanged(stack: Stack) -> None:
    with stack.client() as a:
        sid = new_session(a)
        before = a.get(f"/v1/context/{sid}").json()
        with a.stream(
            "POST",
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": " go",
                "max_tokens": 400,
                "stream": True,
                "session_id": sid,
                "ignore_eos": True,
            },
        ) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
        # the connection is closed: the turn is dropped, the lock given back
        deadline = time.monotonic() + 10
        while True:
            r2 = turn(a, sid, max_tokens=1)
            if r2.status_code != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r2.status_code == 200, r2.text
        after = a.get(f"/v1/context/{sid}").json()
        assert after["turns"] == before["turns"] + 1  # only the completed turn counted
        usage = r2.json()["usage"]
        # the history is exactly: what it was + the completed turn; nothing of the dropped one
        assert after["context_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] == before["context_tokens"] + 1  # " and"


def test_ttl_expiry_and_patch(stack: Stack) -> None:
    with stack.client() as a:
        sid = new_session(a, ttl=1)
        patched = a.patch(f"/v1/context/{sid}", json={"ttl": 3})
        assert patched.status_code == 200 and patched.json()["ttl"] == 3
        time.sleep(1.5)
        assert turn(a, sid).status_code == 200  # patched, and the turn slides the TTL
        time.sleep(3.5)
        envelope(turn(a, sid), 404, "session_not_found")
        assert sid not in {c["session_id"] for c in a.get("/v1/context").json()["data"]}


def sidecar_bytes(stack: Stack, sid: str) -> int:
    r = httpx.get(f"{stack.sidecar_url}/sessions/{session_key(sid)}")
    r.raise_for_status()
    return int(r.json()["bytes"])


def wait_for(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return False


def test_delete_drops_the_sessions_kv(stack: Stack) -> None:
    with stack.client() as a:
        sid = new_session(a)
        assert wait_for(lambda: sidecar_bytes(stack, sid) > 0), "KV never reached the sidecar"
        a.delete(f"/v1/context/{sid}")
        assert wait_for(lambda: sidecar_bytes(stack, sid) == 0), "KV not dropped"


def test_worker_killed_mid_conversation(stack: Stack) -> None:
    """Kill the session's affine worker (as Redis records it: the worker its KV is warm
    on) between turns: the next turn runs on the other one, with the same answer."""
    with stack.client() as a:
        r = a.post(
            "/v1/context", json={"model": "tiny", "prompt": DOC, "max_tokens": 4, "temperature": 0}
        )
        sid = r.json()["session_id"]
        text = DOC + r.json()["choices"][0]["text"]
        r = turn(a, sid, temperature=0, max_tokens=4)  # a turn records the affinity
        assert r.status_code == 200, r.text
        text += " and" + r.json()["choices"][0]["text"]
        store = redis.Redis(port=stack.redis.port)
        try:
            affine = store.hget(f"ctx:{{{sid}}}", "affinity")
        finally:
            store.close()
        assert affine is not None and affine.decode() in ("w0", "w1"), affine
        victim = int(affine.decode()[1:])  # the gateway names its workers w0, w1 in order
        stack.workers[victim].kill()
        try:
            r = turn(a, sid, temperature=0, max_tokens=4)
            assert r.status_code == 200, r.text
            text += " and"
            want = a.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": text, "max_tokens": 4, "temperature": 0},
            )
            assert r.json()["choices"][0]["text"] == want.json()["choices"][0]["text"]
        finally:
            stack.restart_worker(victim)
        assert wait_for(
            lambda: a.get("/ready").status_code == 200 and a.get("/ready").json()["workers"] == 2,
            30,
        )


def test_backend_and_store_failures_map_to_the_table(stack: Stack) -> None:
    dead_redis = f"redis://127.0.0.1:{free_port()}/0"
    dead_worker = f"http://127.0.0.1:{free_port()}"
    gw = aux_gateway(stack, "gw-dead", [dead_worker], dead_redis)
    try:
        with httpx.Client(
            base_url=gw.url, headers={"authorization": "Bearer key-a"}, timeout=30
        ) as c:
            envelope(
                c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}),
                503,
                "backend_unavailable",
            )
            envelope(c.get("/v1/context"), 503, "store_unavailable")
            envelope(c.get("/ready"), 503, "store_unavailable")
    finally:
        gw.stop()
    live = [f"{w.url}={stack.sidecar_url}" for w in stack.workers]
    gw = aux_gateway(stack, "gw-slow", live, stack.redis.url, CTX_GATEWAY_REQUEST_TIMEOUT_S="0.3")
    try:
        with httpx.Client(
            base_url=gw.url, headers={"authorization": "Bearer key-a"}, timeout=30
        ) as c:
            sid = new_session(c)
            envelope(
                c.post(
                    "/v1/completions",
                    json={"model": "tiny", "prompt": "x", "max_tokens": 3000, "ignore_eos": True},
                ),
                504,
                "backend_timeout",
            )
            envelope(turn(c, sid, max_tokens=3000, ignore_eos=True), 504, "backend_timeout")
            assert c.get(f"/v1/context/{sid}").json()["turns"] == 1
            assert wait_for(lambda: turn(c, sid).status_code == 200)  # lock released
    finally:
        gw.stop()
