"""Real vLLM storing and loading session KV through the sidecar, behind the gateway.

Every comparison is greedy text against the same conversation sent in full without a
session, which never touches the sidecar (the connector leaves session-less requests alone).
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import orjson
import pytest

from ctxcache.lmcache_keys import session_key
from sidecar.client import KVClient
from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD
from tests.deploy.monitoring import exposed_names, queried_metrics
from tests.utils import relayed_streams
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, document

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT)

BLOCK = 128  # vLLM's CPU block size: what a cold session may recompute at most


class Chat:
    """One conversation, as a session and as the full history."""

    def __init__(self, stack: VllmStack, seed: int) -> None:
        self.stack = stack
        self.client = stack.http
        self.messages: list[dict[str, str]] = [{"role": "system", "content": document(seed)}]
        r = self.client.post("/v1/context", json={"model": "tiny", "messages": self.messages})
        assert r.status_code == 200, r.text
        self.sid: str = r.json()["session_id"]

    def context_tokens(self) -> int:
        return int(self.info()["context_tokens"])

    def info(self) -> dict[str, Any]:
        r = self.client.get(f"/v1/context/{self.sid}")
        assert r.status_code == 200, r.text
        return r.json()

    def turn(self, question: str) -> tuple[str, dict[str, Any]]:
        """A session turn; returns its text and usage (the conversation grows)."""
        body = {
            "model": "tiny",
            "session_id": self.sid,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 24,
            "temperature": 0,
        }
        r = self.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        self.messages += [{"role": "user", "content": question}]
        usage = r.json()["usage"]
        full = self.full_text()
        self.messages += [{"role": "assistant", "content": text}]
        assert text == full, "a session turn answered differently from the full history"
        return text, usage

    def full_text(self) -> str:
        """The whole conversation passed through to vLLM (never an implicit session's turn,
        which would reuse the sidecar's KV as the session does: docs/implicit.md)."""
        body = {"model": "tiny", "messages": self.messages, "max_tokens": 24, "temperature": 0}
        body["prompt_cache_options"] = {"mode": "explicit"}
        r = self.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def vllm_counter(stack: VllmStack, name: str) -> float:
    """The connector's counter `name` (`vllm:ctxcache_<name>_total`)."""
    return vllm_metric(stack, f"vllm:ctxcache_{name}_total")


def wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_session_turns_reuse_and_answer_like_the_full_history(vllm_stack: VllmStack) -> None:
    chat = Chat(vllm_stack, seed=1)
    for question in ("what is the cat doing?", "and the dogs?", "will it rain?"):
        context = chat.context_tokens()
        _, usage = chat.turn(question)
        assert cached(usage) >= context - BLOCK  # vLLM's own prefix cache, hot


def test_every_vllm_metric_the_dashboard_queries_is_on_vllms_metrics(
    vllm_stack: VllmStack,
) -> None:
    """The dashboard's and the alerts' `vllm:` metrics, against the real vLLM's /metrics
    (after the session turns above: the connector's counters have moved)."""
    text = httpx.get(f"{vllm_stack.vllm.url}/metrics", timeout=30).text
    exposed = exposed_names(text)
    queried = {n: w for n, w in queried_metrics().items() if n.startswith("vllm:")}
    assert "vllm:ctxcache_loaded_tokens_total" in queried
    missing = {name: sorted(where) for name, where in queried.items() if name not in exposed}
    assert not missing, missing


def test_after_a_prefix_cache_reset_the_sidecar_serves_the_session(
    vllm_stack: VllmStack,
) -> None:
    chat = Chat(vllm_stack, seed=2)
    chat.turn("what is the cat doing?")
    held = chat.info()
    assert held["kv_tokens"] >= held["context_tokens"] - BLOCK  # the sidecar holds it all
    assert held["kv_bytes"] > 0
    loaded_before = vllm_counter(vllm_stack, "loaded_tokens")
    # (this module's other tests may have loaded over TCP on purpose: count from here)
    shm_before = vllm_counter(vllm_stack, "load_bytes_shm")
    tcp_before = vllm_counter(vllm_stack, "load_bytes_tcp")
    for question in ("and the dogs?", "will it rain?"):
        vllm_stack.reset_prefix_cache()  # vLLM forgets; only the sidecar can supply KV now
        context = chat.context_tokens()
        _, usage = chat.turn(question)  # also checks the text against the full history
        assert cached(usage) >= context - BLOCK
    wait_for(lambda: vllm_counter(vllm_stack, "loaded_tokens") > loaded_before)
    # through the local sidecar's shared memory, not the socket
    assert vllm_counter(vllm_stack, "load_bytes_shm") > shm_before
    assert vllm_counter(vllm_stack, "load_bytes_tcp") == tcp_before


def test_delete_drops_the_sessions_blocks(vllm_stack: VllmStack) -> None:
    chat = Chat(vllm_stack, seed=3)
    chat.turn("hello?")
    wait_for(lambda: vllm_stack.held(chat.sid)["blocks"] > 0)
    r = chat.client.delete(f"/v1/context/{chat.sid}")
    assert r.status_code == 200, r.text
    wait_for(lambda: vllm_stack.held(chat.sid)["blocks"] == 0)


def test_a_corrupt_block_is_a_miss_not_a_wrong_answer(vllm_stack: VllmStack) -> None:
    chat = Chat(vllm_stack, seed=4)
    chat.turn("what is the cat doing?")
    tag = f"s%{session_key(chat.sid)}"
    with KVClient.from_url(vllm_stack.sidecar_lm) as kv:
        wait_for(lambda: any(k.endswith(tag) for k in kv.list_keys()))
        keys = [k for k in kv.list_keys() if k.endswith(tag)]
        for key in keys:  # same keys, wrong blocks: EXIST says yes, the load must refuse them
            garbage = bytes(range(256)) * 64
            kv.put(key, garbage, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=(2, 4, 32, 64))
        kv.health()  # a round trip after the PUTs: the sidecar has them
    failures = vllm_counter(vllm_stack, "load_failures")
    vllm_stack.reset_prefix_cache()
    chat.turn("and the dogs?")  # answered exactly like the full history
    wait_for(lambda: vllm_counter(vllm_stack, "load_failures") > failures)


def test_a_session_less_request_stores_nothing(vllm_stack: VllmStack) -> None:
    def blocks() -> int:
        return int(httpx.get(f"{vllm_stack.sidecar.url}/stats", timeout=10).json()["blocks"])

    before = blocks()
    body = {"model": "tiny", "prompt": document(5), "max_tokens": 8, "temperature": 0}
    r = vllm_stack.http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    time.sleep(1.0)
    assert blocks() == before


def test_a_stream_without_a_session_is_relayed_as_vllm_sent_it(vllm_stack: VllmStack) -> None:
    """vLLM's own stream through the gateway's relay (`gateway.completions.streams`): the
    same text as its answer in one piece, and its usage chunk."""
    before = relayed_streams(vllm_stack.http)
    body = {"model": "tiny", "prompt": document(3), "max_tokens": 8, "temperature": 0}
    whole = vllm_stack.http.post("/v1/completions", json=body).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with vllm_stack.http.stream("POST", "/v1/completions", json=stream) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert relayed_streams(vllm_stack.http) == before + 1


def test_a_killed_sidecar_costs_speed_only(vllm_stack: VllmStack) -> None:
    chat = Chat(vllm_stack, seed=6)
    chat.turn("what is the cat doing?")
    vllm_stack.sidecar.kill()
    try:
        vllm_stack.reset_prefix_cache()
        context = chat.context_tokens()
        _, usage = chat.turn("and the dogs?")  # same answer as the full history
        assert cached(usage) < context - BLOCK  # recomputed: nothing could be loaded
    finally:
        vllm_stack.restart_sidecar()
    # once the connector's breaker closes, the session is stored and served again
    deadline = time.monotonic() + 120
    while True:
        vllm_stack.reset_prefix_cache()
        context = chat.context_tokens()
        _, usage = chat.turn("anything else?")
        if cached(usage) >= context - BLOCK:
            break
        assert time.monotonic() < deadline, "the sidecar was not used again after a restart"
        time.sleep(2.0)


def vllm_metric(stack: VllmStack, name: str, labels: str = "") -> float:
    """The sum of vLLM's `name` series whose labels contain `labels`."""
    text = httpx.get(f"{stack.vllm.url}/metrics", timeout=30).text
    found = re.findall(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for series, v in found if labels in series)


def vllm_running(stack: VllmStack) -> float:
    return vllm_metric(stack, "vllm:num_requests_running")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_vllms_request(
    vllm_stack: VllmStack, stream: bool, record_property: Any
) -> None:
    """Mid-answer, the client hangs up: vLLM frees the sequence (its gauge drops back to 0
    within seconds, and it generated far fewer than the 1,500 tokens, none of its requests
    ending by length), the session holds nothing of the dropped turn, and the next turn is
    served at once. (Read from vLLM's counters, not by catching its running gauge at 1: a
    step's gauge update comes after its tokens, and on a busy machine a poll can miss it.)"""
    chat = Chat(vllm_stack, seed=7)
    before = chat.info()
    wait_for(lambda: vllm_running(vllm_stack) == 0)  # nothing left over from other tests
    generated = vllm_metric(vllm_stack, "vllm:generation_tokens_total")
    by_length = vllm_metric(vllm_stack, "vllm:request_success_total", 'finished_reason="length"')
    body = {
        "model": "tiny",
        "session_id": chat.sid,
        "messages": [{"role": "user", "content": "tell me everything"}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        with vllm_stack.http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            for event in events:  # until a token has come: vLLM generates
                delta = orjson.loads(event[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    break
    else:
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.Client(base_url=vllm_stack.url) as leaving,
        ):
            leaving.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=3))
    t0 = time.monotonic()
    while vllm_running(vllm_stack) != 0:
        assert time.monotonic() - t0 < 5.0  # (the whole answer would take far longer)
        time.sleep(0.02)
    record_property("seconds_until_vllm_runs_nothing", round(time.monotonic() - t0, 3))
    spent = vllm_metric(vllm_stack, "vllm:generation_tokens_total") - generated
    record_property("tokens_generated_before_the_abort", spent)
    assert 0 < spent < 1500
    finished = vllm_metric(vllm_stack, "vllm:request_success_total", 'finished_reason="length"')
    assert finished == by_length  # aborted, not run to its end
    assert chat.info()["turns"] == before["turns"]
    assert chat.info()["context_tokens"] == before["context_tokens"]
    t0 = time.monotonic()
    chat.turn("and then?")  # the lock is free: no wait for its TTL
    assert time.monotonic() - t0 < 60
