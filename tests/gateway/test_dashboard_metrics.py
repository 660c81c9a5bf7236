"""Every ctxcache metric the dashboard or an alert queries exists in the `/metrics` of a
running stack (gateway, sidecar, built-in workers); vLLM's are checked against vLLM
(tests/deploy/test_monitoring.py, tests/vllm_connector/test_vllm_e2e.py)."""

from __future__ import annotations

import httpx

from tests.deploy.monitoring import SYNTHETIC, exposed_names, queried_metrics
from tests.gateway.conftest import Stack
from tests.utils import metric


def test_every_queried_metric_is_exposed_by_the_running_stack(stack: Stack) -> None:
    with stack.client() as a:  # a session and a turn, so that labelled series exist
        sid = a.post("/v1/context", json={"model": "tiny", "prompt": "word " * 100}).json()[
            "session_id"
        ]
        r = a.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": " more", "max_tokens": 2, "session_id": sid},
        )
        assert r.status_code == 200, r.text
        plain = a.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert plain.status_code == 200, plain.text
    urls = [stack.url, stack.sidecar_url, *(w.url for w in stack.workers)]
    texts = {url: httpx.get(f"{url}/metrics", timeout=30).text for url in urls}
    exposed = set().union(*(exposed_names(t) for t in texts.values()))
    queried = queried_metrics()
    ours = {n: w for n, w in queried.items() if not n.startswith("vllm:") and n not in SYNTHETIC}
    assert len(ours) >= 20, sorted(ours)  # the dashboard was read at all
    missing = {name: sorted(where) for name, where in ours.items() if name not in exposed}
    assert not missing, missing

    gateway = texts[stack.url]
    turns = 'ctxcache_gateway_turns_total{kind="completion",tenant="tenant-a"}'
    assert metric(gateway, turns) >= 1
    assert metric(gateway, 'ctxcache_gateway_tenant_sessions{tenant="tenant-a"}') >= 1
    assert metric(gateway, "ctxcache_gateway_store_up") == 1
    for mode in ("session", "plain"):
        assert metric(gateway, f'ctxcache_gateway_ttft_seconds_count{{mode="{mode}"}}') >= 1
        assert metric(gateway, f'ctxcache_gateway_completion_seconds_count{{mode="{mode}"}}') >= 1
    assert sid not in gateway
