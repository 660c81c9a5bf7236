"""vLLM's own spans join the gateway's trace: `ctxcache vllm`'s launch passes
`--otlp-traces-endpoint` from `OTEL_EXPORTER_OTLP_ENDPOINT`, and the gateway sends
`traceparent` with the turn's generation call (slow: starts a real vLLM)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from benchmarks.lib.otlp_sink import OtlpSink
from ctxcache import tracing
from ctxcache.net import free_port
from ctxcache.vllm_engine import VllmLaunch
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.utils import VllmProcess, require_vllm
from tests.vllm_connector.conftest import VLLM_TIMEOUT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(VLLM_TIMEOUT)]


async def test_vllms_request_span_is_a_child_of_the_gateways_generation(
    tmp_path: Path, tiny_model: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_vllm()
    with OtlpSink() as sink:
        monkeypatch.setenv(tracing.ENDPOINT_ENV, sink.endpoint)
        launch = VllmLaunch(model=str(tiny_model), served_name="tiny", port=free_port())
        assert "--otlp-traces-endpoint" in launch.argv()
        vllm = VllmProcess(launch, log_path=tmp_path / "vllm.log")
        monkeypatch.delenv(tracing.ENDPOINT_ENV)  # this process: the in-memory exporter
        memory = InMemorySpanExporter()
        tracing.configure("gateway", exporter=memory)
        try:
            with vllm:
                settings = GatewaySettings(redis_url=redis_url, workers=[vllm.url])
                app = tracing.server_middleware(create_app(settings), "gateway")
                async with LifespanManager(app) as running:  # type: ignore[arg-type]
                    transport = httpx.ASGITransport(app=running.app)
                    async with httpx.AsyncClient(
                        transport=transport, base_url="http://gw", timeout=120
                    ) as client:
                        r = await client.post(
                            "/v1/context", json={"model": "tiny", "prompt": "one two three"}
                        )
                        sid = r.json()["session_id"]
                        memory.clear()
                        body = {"model": "tiny", "prompt": " four", "max_tokens": 3}
                        r = await client.post("/v1/completions", json={**body, "session_id": sid})
                        assert r.status_code == 200, r.text
                generate = next(
                    s for s in memory.get_finished_spans() if s.name == "ctxcache.generate"
                )
                ctx = generate.get_span_context()
                assert ctx is not None
                trace_id, span_id = f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"
                deadline = time.monotonic() + 30
                while not (
                    found := [s for s in sink.spans() if s.trace_id == trace_id]
                ):  # vLLM exports in batches
                    assert time.monotonic() < deadline, "vLLM exported no span of the trace"
                    await asyncio.sleep(0.2)
        finally:
            tracing.shutdown()
    (span,) = found
    assert span.name == "llm_request" and span.parent_id == span_id, span
