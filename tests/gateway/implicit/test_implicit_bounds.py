"""Implicit sessions' hostile inputs, switches and expiry (docs/implicit.md): a bad
prompt-caching field is a 400 naming it; odd histories are served or refused, never a 500,
and never reuse another conversation; a deployment or tenant switch and an idle TTL bound
what is kept."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from benchmarks.lib.process import Process
from benchmarks.lib.stack import Gateway
from tests.gateway.conftest import Stack
from tests.gateway.implicit.test_implicit_e2e import system


def chat(http: httpx.Client, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
    doc = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **body}
    return http.post("/v1/chat/completions", json=doc)


def counts(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith('ctxcache_gateway_implicit_total{result="'):
            name, value = line.split()
            out[name.split('"')[1]] = float(value)
    return out


def two_turns(http: httpx.Client, tag: str, **body: Any) -> tuple[httpx.Response, httpx.Response]:
    history: list[dict[str, Any]] = [system(tag), {"role": "user", "content": "One?"}]
    first = chat(http, history, **body)
    assert first.status_code == 200, first.text
    history += [first.json()["choices"][0]["message"], {"role": "user", "content": "Two?"}]
    return first, chat(http, history, **body)


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("prompt_cache_key", "k" * 10_240, "prompt_cache_key"),
        ("prompt_cache_key", 42, "prompt_cache_key"),
        ("prompt_cache_key", {"nested": "key"}, "prompt_cache_key"),
        ("prompt_cache_retention", "forever", "prompt_cache_retention"),
        ("prompt_cache_options", "implicit", "prompt_cache_options"),
        ("prompt_cache_options", {"mode": "sometimes"}, "prompt_cache_options.mode"),
        ("prompt_cache_options", {"ttl": "30 minutes"}, "prompt_cache_options.ttl"),
    ],
)
def test_a_bad_prompt_caching_field_is_a_400_naming_it(
    stack: Stack, field: str, value: Any, param: str
) -> None:
    with stack.client() as http:
        before = counts(stack.url)
        for session in (None, "ctx_" + "A" * 32):  # (a session turn checks them too)
            extra = {"session_id": session} if session else {}
            r = chat(http, [{"role": "user", "content": "Hi?"}], **{field: value}, **extra)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert counts(stack.url) == before  # nothing ran, nothing was kept


def test_a_malformed_breakpoint_is_a_400_and_a_good_one_is_served(stack: Stack) -> None:
    part = {"type": "text", "text": "Hi?", "prompt_cache_breakpoint": {"mode": "sometimes"}}
    with stack.client() as http:
        r = chat(http, [{"role": "user", "content": [part]}])
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[0].content[0].prompt_cache_breakpoint"
        part["prompt_cache_breakpoint"] = {"mode": "explicit", "ttl": "12h"}
        r = chat(http, [{"role": "user", "content": [part]}])
        assert r.status_code == 200, r.text


def test_ten_thousand_messages_are_served_or_refused_never_a_500(stack: Stack) -> None:
    messages: list[dict[str, Any]] = []
    for i in range(5_000):
        messages += [
            {"role": "user", "content": f"q{i}"},
            {"role": "assistant", "content": f"a{i}"},
        ]
    messages.append({"role": "user", "content": "last?"})
    with stack.client() as http:
        r = chat(http, messages)
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:  # (over the tiny model's window)
        assert r.json()["error"]["code"] in ("context_length_exceeded", "invalid_request")


def test_deeply_nested_content_is_never_matched_nor_a_500(stack: Stack) -> None:
    nested: Any = "deep"
    for _ in range(200):
        nested = {"x": nested}
    part = {"type": "text", "text": "Hi?", "extra": nested}
    with stack.client() as http:
        before = counts(stack.url)
        for _ in range(2):
            r = chat(http, [system("nested"), {"role": "user", "content": [part]}])
            assert r.status_code in (200, 400), r.text[:300]
        after = counts(stack.url)
    assert after["hit"] == before["hit"] and after["branch"] == before["branch"]


def test_duplicate_tool_call_ids_are_served_or_refused_never_a_500(stack: Stack) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        system("dupes"),
        {"role": "user", "content": "Call f twice."},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_1", "content": "two"},
    ]
    with stack.client() as http:
        r = chat(http, messages)
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_history_this_gateway_never_answered_starts_a_conversation(stack: Stack) -> None:
    made_up = [
        system("made-up"),
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "An answer nobody generated."},
        {"role": "user", "content": "Two?"},
    ]
    with stack.client() as http:
        before = counts(stack.url)
        r = chat(http, made_up)
        assert r.status_code == 200, r.text
        after = counts(stack.url)
    assert after["miss"] - before["miss"] == 1 and after["hit"] == before["hit"]


@pytest.fixture(scope="module")
def switched(stack: Stack) -> Iterator[Process]:
    """A gateway whose tenant-b has implicit sessions off, and whose states live 2 s."""
    workers = [f"{w.url}={stack.sidecar_url}" for w in stack.workers]
    env = {
        "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5",
        "CTX_GATEWAY_IMPLICIT_OFF_TENANTS": '["tenant-b"]',
        "CTX_GATEWAY_IMPLICIT_TTL": "2",
        "CTX_GATEWAY_MIN_TTL": "1",
    }
    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}
    gateway = Gateway("implicit-switched", keys=keys, env=env, log_level=None, timeout=60.0)
    g = stack.extra_gateway(gateway, stack.redis.url, workers, ready_path="/health")
    try:
        yield g
    finally:
        g.stop()


def test_a_tenant_with_implicit_sessions_off_is_passed_through(switched: Process) -> None:
    with httpx.Client(
        base_url=switched.url, timeout=120, headers={"authorization": "Bearer key-b"}
    ) as http:
        before = counts(switched.url)
        two_turns(http, "off")
        after = counts(switched.url)
    assert after["passed"] - before["passed"] == 2
    assert after["miss"] == before["miss"] and after["hit"] == before["hit"]


def test_a_state_idle_past_its_ttl_is_gone(switched: Process) -> None:
    with httpx.Client(
        base_url=switched.url, timeout=120, headers={"authorization": "Bearer key-a"}
    ) as http:
        history: list[dict[str, Any]] = [system("expiry"), {"role": "user", "content": "One?"}]
        first = chat(http, history)
        history += [first.json()["choices"][0]["message"], {"role": "user", "content": "Two?"}]
        time.sleep(3.0)  # (the state's ttl is 2 s)
        before = counts(switched.url)
        r = chat(http, history)
        assert r.status_code == 200
        after = counts(switched.url)
    assert after["miss"] - before["miss"] == 1 and after["hit"] == before["hit"]


def test_implicit_sessions_give_way_to_explicit_ones_at_the_quota(stack: Stack) -> None:
    """tenant-c may hold one session: its implicit conversation is evicted by a create, and
    a conversation that then finds no room is answered all the same, not kept."""
    with stack.client("key-c") as http:
        first, _ = two_turns(http, "quota-c")  # an implicit session: tenant-c's one
        assert first.status_code == 200
        ask = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": True}
        made = http.post("/v1/context", json=ask)
        assert made.status_code == 200, made.text  # (the implicit one gave way, up front too)
        sid = made.headers["x-session-id"]
        try:
            assert [s["session_id"] for s in http.get("/v1/context").json()["data"]] == [sid]
            before = counts(stack.url)
            r = chat(http, [system("quota-c2"), {"role": "user", "content": "Hi?"}])
            assert r.status_code == 200, r.text  # answered, though it cannot be kept
            assert counts(stack.url)["unkept"] - before["unkept"] == 1
            assert [s["session_id"] for s in http.get("/v1/context").json()["data"]] == [sid]
        finally:
            http.delete(f"/v1/context/{sid}")
