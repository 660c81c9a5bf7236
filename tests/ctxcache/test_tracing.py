"""Tracing (ctxcache/tracing.py): off by default and then out of the way; on, one session
turn is one trace across the gateway, the manager and the worker (three processes).

The gateway runs in this process with the SDK's in-memory exporter; the manager and the
worker are real `ctxcache manager` / `ctxcache worker` processes exporting over OTLP/HTTP
to a receiver of this test (`benchmarks.lib.otlp_sink`), so the worker's spans prove it got the
gateway's `traceparent`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from benchmarks.lib.otlp_sink import OtlpSink, ReceivedSpan
from ctxcache import tracing
from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.worker_client import WorkerClient
from tests.utils import ServiceProcess

KEY = "key-t"
AUTH = {"authorization": f"Bearer {KEY}"}


def _client() -> WorkerClient:
    """A worker client, to see the bytes of the requests it would write (the one place
    every call to a worker is encoded)."""
    return WorkerClient("http://h:1", connect_timeout_s=1, request_timeout_s=1)


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    assert tracing.configure("gateway", exporter=exporter)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def test_off_by_default_nothing_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    assert tracing.configure("gateway") is False and not tracing.enabled()
    first, second = tracing.span("a", {"x": 1}), tracing.span("b", client=True)
    assert first is second  # one shared do-nothing context manager: no span object
    assert tracing.detached("c") is first
    assert tracing.outgoing_headers() == []
    assert tracing.inject({"a": "b"}) == {"a": "b"}

    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    assert tracing.server_middleware(app, "worker") is app
    request = _client()._encode("POST", "/p", b"{}", ())
    assert b"traceparent" not in request.lower()


def test_on_a_call_carries_the_current_span(memory: InMemorySpanExporter) -> None:
    client = _client()
    assert b"traceparent" not in client._encode("POST", "/p", b"{}", ())  # no span: none
    with tracing.span("call", client=True):  # a call outside any request starts no trace
        assert b"traceparent" not in client._encode("POST", "/p", b"{}", ())
    assert memory.get_finished_spans() == ()
    with tracing.span("request"), tracing.span("call", client=True):
        request = client._encode("POST", "/p", b"{}", ((b"x-a", b"1"),))
    span = next(s for s in memory.get_finished_spans() if s.name == "call")
    ctx = span.get_span_context()
    assert ctx is not None
    flags = int(ctx.trace_flags)
    want = f"traceparent: 00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{flags:02x}\r\n".encode()
    assert want in request
    head, _, body = request.partition(b"\r\n\r\n")
    assert body == b"{}" and b"Content-Length: 2" in head  # still a well-formed request
    assert b"\r\nx-a: 1\r\n" in head  # the caller's own headers kept


def test_an_environment_endpoint_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    with OtlpSink() as sink:
        monkeypatch.setenv(tracing.ENDPOINT_ENV, sink.endpoint)
        try:
            assert tracing.configure("gateway") and tracing.enabled()
            with tracing.span("hello", {tracing.SESSION_ATTR: "ctx_1"}):
                pass
        finally:
            tracing.shutdown()  # exports what is pending
        (span,) = sink.spans()
    assert (span.service, span.name) == ("ctxcache-gateway", "hello")
    assert span.attributes[tracing.SESSION_ATTR] == "ctx_1"


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    with OtlpSink() as s:
        yield s


@pytest.fixture(scope="module")
def traced_services(
    sink: OtlpSink, redis_server: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    """A real manager and worker, each exporting its spans to `sink`."""
    root = tmp_path_factory.mktemp("traced")
    env = {tracing.ENDPOINT_ENV: sink.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    manager = ServiceProcess(
        ["manager", "--redis-url", redis_server.url, "--token", "t0k"],
        env=env,
        log_path=root / "manager.log",
    )
    worker = ServiceProcess(
        ["worker", "--model", str(tiny_model), "--threads", "1"],
        env=env,
        log_path=root / "worker.log",
        startup_timeout=120,
    )
    with manager, worker:
        yield manager, worker


@pytest.fixture
async def gateway(
    memory: InMemorySpanExporter, traced_services: tuple[ServiceProcess, ServiceProcess]
) -> AsyncIterator[httpx.AsyncClient]:
    manager, worker = traced_services
    settings = GatewaySettings(
        manager_url=manager.url,
        manager_token="t0k",
        workers=[f"{worker.url}"],
        api_keys={KEY: "tenant-t"},
    )
    app = tracing.server_middleware(create_app(settings), "gateway")
    async with LifespanManager(app) as running:  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=running.app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gw", headers=AUTH, timeout=60
        ) as client:
            yield client


def _hex(span: ReadableSpan) -> tuple[str, str, str]:
    ctx = span.get_span_context()
    assert ctx is not None
    parent = f"{span.parent.span_id:016x}" if span.parent is not None else ""
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}", parent


def _children(sink: OtlpSink, trace_id: str, parents: set[str]) -> dict[str, ReceivedSpan]:
    """The received spans of `trace_id` whose parents are `parents`, by parent id, once
    every one has come (the services export in batches)."""
    deadline = time.monotonic() + 15
    while True:
        found = {s.parent_id: s for s in sink.spans() if s.trace_id == trace_id}
        if parents <= set(found):
            return found
        assert time.monotonic() < deadline, f"no children of {parents - set(found)}: {found}"
        time.sleep(0.1)


async def test_a_session_turn_is_one_trace_across_gateway_manager_and_worker(
    gateway: httpx.AsyncClient, memory: InMemorySpanExporter, sink: OtlpSink
) -> None:
    r = await gateway.post("/v1/context", json={"model": "tiny", "prompt": "one two three " * 8})
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    memory.clear()
    r = await gateway.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": " four", "max_tokens": 3, "session_id": sid},
    )
    assert r.status_code == 200, r.text

    spans = memory.get_finished_spans()
    (root,) = [s for s in spans if s.kind == SpanKind.SERVER]
    trace_id, root_id, root_parent = _hex(root)
    assert root.name == "POST /v1/completions" and root_parent == ""
    assert root.attributes is not None and root.attributes[tracing.SESSION_ATTR] == sid
    assert all(_hex(s)[0] == trace_id for s in spans), "one trace"
    children = {s.name: s for s in spans if _hex(s)[2] == root_id}
    assert {
        "ctxcache.auth",
        "manager POST /sessions/{session_id}/begin",
        "ctxcache.tokenize",
        "ctxcache.generate",
        "ctxcache.commit",
    } <= set(children), sorted(children)
    (append,) = [s for s in spans if s.name == "manager POST /sessions/{session_id}/append"]
    assert _hex(append)[2] == _hex(children["ctxcache.commit"])[1]  # under the commit
    for name in ("manager POST /sessions/{session_id}/begin", "ctxcache.generate"):
        attributes = children[name].attributes
        assert attributes is not None and attributes[tracing.SESSION_ATTR] == sid

    # the other two processes continued the same trace, each server span under the
    # gateway's call that made it: the worker got `traceparent` from both of its calls
    calls = {
        "manager POST /sessions/{session_id}/begin": (
            "ctxcache-manager",
            "POST /sessions/{session_id}/begin",
        ),
        "ctxcache.tokenize": ("ctxcache-worker", "POST /tokenize"),
        "ctxcache.generate": ("ctxcache-worker", "POST /v1/completions"),
    }
    ids = {_hex(children[name])[1]: want for name, want in calls.items()}
    ids[_hex(append)[1]] = ("ctxcache-manager", "POST /sessions/{session_id}/append")
    received = _children(sink, trace_id, set(ids))
    for parent, (service, name) in ids.items():
        got = received[parent]
        assert (got.service, got.name, got.kind) == (service, name, 2), got  # 2: SERVER

    # probes and scrapes start no trace (nor do the store calls a scrape makes)
    memory.clear()
    for path in ("/metrics", "/health", "/ready"):
        assert (await gateway.get(path)).status_code == 200
    assert memory.get_finished_spans() == ()


async def test_an_in_process_manager_s_calls_are_spans_of_the_same_names(
    memory: InMemorySpanExporter,
    traced_services: tuple[ServiceProcess, ServiceProcess],
    redis_url: str,
) -> None:
    _, worker = traced_services
    settings = GatewaySettings(redis_url=redis_url, workers=[worker.url], api_keys={KEY: "t"})
    app = tracing.server_middleware(create_app(settings), "gateway")
    async with LifespanManager(app) as running:  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=running.app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gw", headers=AUTH, timeout=60
        ) as client:
            r = await client.post("/v1/context", json={"model": "tiny", "prompt": "one two"})
            sid = r.json()["session_id"]
            memory.clear()
            caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # a client's
            r = await client.post(
                "/v1/completions",
                json={"model": "tiny", "prompt": " three", "max_tokens": 2, "session_id": sid},
                headers={"traceparent": caller},
            )
            assert r.status_code == 200, r.text
    spans = {s.name: s for s in memory.get_finished_spans()}
    # the gateway continues a trace its caller started
    assert _hex(spans["POST /v1/completions"])[0::2] == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
    )
    begin = spans["manager POST /sessions/{session_id}/begin"]
    assert begin.kind == SpanKind.INTERNAL and begin.attributes is not None
    assert begin.attributes[tracing.SESSION_ATTR] == sid
    root = spans["POST /v1/completions"]
    assert _hex(begin)[2] == _hex(root)[1] and _hex(begin)[0] == _hex(root)[0]
    append = spans["manager POST /sessions/{session_id}/append"]
    assert _hex(append)[2] == _hex(spans["ctxcache.commit"])[1]
