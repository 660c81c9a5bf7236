"""Every ctxcache metric the dashboard or an alert queries exists in what a running stack
serves (the gateway's `/metrics` and, with its metrics token, `/metrics/tenants`; the
manager's, the sidecar's and the built-in workers' `/metrics`); vLLM's are checked against
vLLM (tests/deploy/test_monitoring.py, tests/vllm_connector/test_vllm_e2e.py), Redis'
(`redis_*`, from redis_exporter) in tests/deploy/test_dashboard.py."""

from __future__ import annotations

import httpx

from tests.deploy.monitoring import SYNTHETIC, exposed_names, queried_metrics
from tests.gateway.conftest import Stack, aux_gateway
from tests.utils import ServiceProcess, metric

TOKEN = "a-metrics-token-of-the-test"


def test_every_queried_metric_is_exposed_by_the_running_stack(stack: Stack) -> None:
    workers = [f"{w.url}={stack.sidecar_url}" for w in stack.workers]
    gateway = aux_gateway(
        stack, "gw-metrics", workers, stack.redis.url, CTX_GATEWAY_METRICS_TOKEN=TOKEN
    )
    manager = ServiceProcess(
        ["manager", "--redis-url", stack.redis.url, "--token", "a-manager-token"],
        log_path=stack.root / "manager-metrics.log",
    )
    try:
        manager.start()
        auth = {"authorization": "Bearer key-a"}
        with httpx.Client(base_url=gateway.url, timeout=120, headers=auth) as a:
            # a session, a turn and a plain request, so that labelled series exist
            r = a.post("/v1/context", json={"model": "tiny", "prompt": "word " * 100})
            sid = r.json()["session_id"]
            body = {"model": "tiny", "prompt": " more", "max_tokens": 2}
            r = a.post("/v1/completions", json={**body, "session_id": sid})
            assert r.status_code == 200, r.text
            r = a.post("/v1/completions", json={**body, "prompt": "hi"})
            assert r.status_code == 200, r.text
        urls = [gateway.url, manager.url, stack.sidecar_url, *(w.url for w in stack.workers)]
        texts = {url: httpx.get(f"{url}/metrics", timeout=30).text for url in urls}
        tenants = httpx.get(
            f"{gateway.url}/metrics/tenants", headers={"authorization": f"Bearer {TOKEN}"}
        )
        assert tenants.status_code == 200, tenants.text
    finally:
        gateway.stop()
        manager.stop()
    exposed = set().union(*(exposed_names(t) for t in [*texts.values(), tenants.text]))
    queried = queried_metrics()
    external = ("vllm:", "redis_")
    ours = {n: w for n, w in queried.items() if not n.startswith(external) and n not in SYNTHETIC}
    assert len(ours) >= 20, sorted(ours)  # the dashboard was read at all
    missing = {name: sorted(where) for name, where in ours.items() if name not in exposed}
    assert not missing, missing

    for url, text in texts.items():  # every service's process (its own registry)
        assert metric(text, "process_resident_memory_bytes") > 0, url
        assert metric(text, "process_open_fds") > 0, url

    public = texts[gateway.url]
    assert "tenant-a" not in public and sid not in public  # /metrics names no tenant, no id
    assert metric(public, 'ctxcache_gateway_turns_total{kind="completion"}') >= 1
    assert metric(public, "ctxcache_gateway_store_up") == 1
    for mode in ("session", "plain"):
        ttft = f'ctxcache_gateway_ttft_seconds_count{{mode="{mode}",stream="false"}}'
        assert metric(public, ttft) >= 1
        assert metric(public, f'ctxcache_gateway_completion_seconds_count{{mode="{mode}"}}') >= 1
    # the implicit panels' series exist from the start, at 0 until counted: a gateway
    # that has served no request without a session draws 0s, not "no data"
    lines = {line.split(" ")[0] for line in public.splitlines() if not line.startswith("#")}
    for result in ("hit", "branch", "miss", "passed", "unkept"):
        assert f'ctxcache_gateway_implicit_total{{result="{result}"}}' in lines, result
    for kind in ("explicit", "implicit", "shared"):
        assert f'ctxcache_gateway_cached_tokens_by_kind_total{{kind="{kind}"}}' in lines, kind
    # the session turn reused its context's KV: counted as explicit
    assert metric(public, 'ctxcache_gateway_cached_tokens_by_kind_total{kind="explicit"}') >= 64
    turns = 'ctxcache_tenant_turns_total{kind="completion",tenant="tenant-a"}'
    assert metric(tenants.text, turns) >= 1
    assert metric(tenants.text, 'ctxcache_tenant_live_sessions{tenant="tenant-a"}') >= 1
