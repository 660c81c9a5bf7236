"""One cold session turn on the real vLLM, traced end to end: every process of the stack
exports to one OTLP receiver, the client sends its own `traceparent`, and under that one
trace id are the gateway's spans, the manager service's, vLLM's `llm_request`, the
connector's lookup and load (with the tokens found and the bytes moved through shared
memory), the sidecar's side of the load (its lease of the blocks in the shared region) and
its control API's pin of the session (slow: starts its own vLLM)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.lib.otlp_sink import OtlpSink, ReceivedSpan
from ctxcache import tracing
from ctxcache.redis_server import RedisServer
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, document, started_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(VLLM_TIMEOUT)]


@pytest.fixture
def traced(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    tiny_model: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[OtlpSink, VllmStack]]:
    with OtlpSink() as sink:
        monkeypatch.setenv(tracing.ENDPOINT_ENV, sink.endpoint)  # every process of the stack
        with started_stack(tmp_path_factory, redis_server, tiny_model, manager=True) as stack:
            yield sink, stack


def test_a_cold_turns_trace_shows_the_kv_path(traced: tuple[OtlpSink, VllmStack]) -> None:
    sink, stack = traced
    system = {"role": "system", "content": document(11)}
    r = stack.http.post("/v1/context", json={"model": "tiny", "messages": [system]})
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    deadline = time.monotonic() + 30
    while stack.held(sid)["blocks"] == 0:  # the create's KV reaches the sidecar after it answers
        assert time.monotonic() < deadline, "the session's KV never reached the sidecar"
        time.sleep(0.2)
    stack.reset_prefix_cache()  # cold: the history must come back from the sidecar
    # the turn slides the session's expiry past the create's pin (whole seconds), so the
    # manager pins again, under the turn's trace (docs/sidecar.md, pins)
    time.sleep(1.5)

    trace_id = secrets.token_hex(16)
    body = {
        "model": "tiny",
        "session_id": sid,
        "messages": [{"role": "user", "content": "what is the cat doing?"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    r = stack.http.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 500  # the cold turn loaded its history

    wanted = {
        "gateway": lambda s: s.service == "ctxcache-gateway",
        "manager": lambda s: s.service == "ctxcache-manager",
        "vllm": lambda s: s.name == "llm_request",
        "lookup": lambda s: s.name == "ctxcache.kv.lookup",
        "load": lambda s: s.name == "ctxcache.kv.load",
        "sidecar lease": lambda s: s.name == "sidecar local lease",
        "sidecar pin": lambda s: s.service == "ctxcache-sidecar" and s.name.startswith("PUT "),
    }
    deadline = time.monotonic() + 30
    while True:  # each process exports in batches (every few seconds)
        spans = [s for s in sink.spans() if s.trace_id == trace_id]
        missing = [name for name, match in wanted.items() if not any(map(match, spans))]
        if not missing:
            break
        assert time.monotonic() < deadline, (missing, [(s.service, s.name) for s in spans])
        time.sleep(0.5)

    def one(name: str) -> ReceivedSpan:
        return next(s for s in spans if s.name == name)

    lookup, load, lease = (
        one("ctxcache.kv.lookup"),
        one("ctxcache.kv.load"),
        one("sidecar local lease"),
    )
    assert lookup.service == load.service == one("llm_request").service == "vllm"
    assert lookup.attributes["ctxcache.kv.found_tokens"] >= cached
    assert lookup.attributes[tracing.SESSION_ATTR]
    assert (
        load.attributes["ctxcache.kv.loaded_tokens"]
        == load.attributes["ctxcache.kv.planned_tokens"]
    )
    assert load.attributes["ctxcache.kv.bytes_shm"] > 0
    assert lease.service == "ctxcache-sidecar" and lease.parent_id == load.span_id
    assert lease.attributes["ctxcache.kv.bytes_shm"] == load.attributes["ctxcache.kv.bytes_shm"]
    # the connector's spans and vLLM's are children of the gateway's call to vLLM
    generate = one("ctxcache.generate")
    assert one("llm_request").parent_id == generate.span_id
    assert lookup.parent_id == load.parent_id == generate.span_id
