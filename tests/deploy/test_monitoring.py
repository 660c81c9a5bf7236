"""The dashboard and the alert rules: well-formed, and every query reads a metric that
exists. ctxcache's own metrics are checked against a running stack
(tests/gateway/test_dashboard_metrics.py); vLLM's here against the installed vLLM's source,
and against a real vLLM's /metrics in tests/vllm_connector/test_vllm_e2e.py."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from tests.deploy.monitoring import (
    ALERTS,
    MONITORING,
    SYNTHETIC,
    alert_rules,
    dashboard,
    dashboard_queries,
    exposed_names,
    metric_names,
    queried_metrics,
    vllm_names_from_source,
)
from vllm_connector.stats import COUNTERS


def test_the_parser_finds_metrics_not_functions_labels_or_numbers() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, mode) (rate(a_seconds_bucket{mode="x y"}'
        "[$__rate_interval]))) / on() group_left() (sum(rate(b_total[5m])) + c) > 1e6"
        " and vllm:num_requests_running offset 5m unless bool d"
    )
    assert metric_names(expr) == {
        "a_seconds_bucket",
        "b_total",
        "c",
        "vllm:num_requests_running",
        "d",
    }
    assert metric_names("sum without (instance) (x)") == {"x"}
    assert metric_names("time() - 3") == set()


def test_the_dashboard_is_a_grafana_dashboard_with_unique_panels() -> None:
    d = dashboard()
    assert d["uid"] == "ctxcache-overview" and d["schemaVersion"] >= 36
    panels = d["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["description"], f"{p['title']}: every panel says what it shows"
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
    # no two panels overlap
    cells = set()
    for p in panels:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, p["title"]
                cells.add((x, y))


def test_the_dashboard_answers_the_operators_questions() -> None:
    read = {name for _, expr in dashboard_queries() for name in metric_names(expr)}
    for wanted in (
        "ctxcache_gateway_requests_total",  # rate and errors by endpoint and status
        "ctxcache_gateway_ttft_seconds_bucket",  # TTFT p50/p95/p99, session vs plain
        "ctxcache_gateway_completion_seconds_bucket",  # end-to-end, session vs plain
        "ctxcache_gateway_cached_tokens_total",  # cached-token ratio
        "ctxcache_tenant_live_sessions",  # live sessions by tenant
        "ctxcache_tenant_turns_total",  # turns by tenant
        "ctxcache_sidecar_memory_bytes_used",
        "ctxcache_sidecar_disk_bytes_used",
        "ctxcache_sidecar_hits_total",  # hit rate by tier
        "ctxcache_sidecar_evictions_total",
        "ctxcache_sidecar_refused_blocks_total",  # refused pins
        "vllm:ctxcache_loaded_tokens_total",  # connector loads / stores
        "vllm:ctxcache_stored_tokens_total",
        "vllm:ctxcache_load_ms_total",  # the engine time they cost
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "ctxcache_gateway_store_up",  # Redis health
        "ctxcache_gateway_worker_healthy",
    ):
        assert wanted in read, wanted
    ttft = [e for t, e in dashboard_queries() if "ctxcache_gateway_ttft_seconds_bucket" in e]
    assert {q for e in ttft for q in ("0.5", "0.95", "0.99") if f"({q}," in e} == {
        "0.5",
        "0.95",
        "0.99",
    }
    assert all("mode" in e for e in ttft), "split by session turn vs plain request"


def test_the_alerts_cover_what_pages_someone() -> None:
    rules = {r["alert"]: r for r in alert_rules()}
    assert {
        "CtxcacheHighErrorRate",
        "CtxcacheSlowTTFT",
        "CtxcacheSidecarRefusing",
        "CtxcacheStoreUnavailable",
        "CtxcacheNoHealthyWorker",
    } <= set(rules)
    for name, r in rules.items():
        assert r["labels"]["severity"] in {"page", "warning"}, name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        assert r.get("for"), f"{name}: a blip does not page"


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="no promtool on PATH: it comes with Prometheus (Debian and Ubuntu: "
    "`apt-get install prometheus`; or the promtool of a Prometheus release)",
)
def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    out = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # and it does refuse a broken rule (the check is not a formality)
    broken = yaml.safe_load(ALERTS.read_text())
    broken["groups"][0]["rules"][0]["expr"] = "sum(rate(x[5m]) >"
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(broken))
    out = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, check=False
    )
    assert out.returncode != 0


def test_compose_and_the_overlays_provision_the_same_files() -> None:
    compose = yaml.safe_load((MONITORING.parents[1] / "docker-compose.yml").read_text())
    mounts = [
        v.split(":")[0]
        for name in ("prometheus", "grafana")
        for v in compose["services"][name]["volumes"]
        if v.startswith("./")
    ]
    assert set(mounts) == {
        "./deploy/monitoring/prometheus.yml",
        "./deploy/monitoring/alerts.yml",
        "./deploy/monitoring/grafana/provisioning",
        "./deploy/monitoring/grafana/dashboards",
    }
    for name in ("prometheus", "grafana"):
        assert compose["services"][name]["profiles"] == ["monitoring"], name
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    files = {f for g in kustomization["configMapGenerator"] for f in g["files"]}
    assert files == {
        "grafana/dashboards/ctxcache.json",
        "prometheus.yml=prometheus-k8s.yml",
        "alerts.yml",
    }
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in prometheus["scrape_configs"]}
    k8s = yaml.safe_load((MONITORING / "prometheus-k8s.yml").read_text())
    assert (
        jobs
        == {j["job_name"] for j in k8s["scrape_configs"]}
        == {
            "ctxcache-gateway",
            "ctxcache-gateway-tenants",
            "ctxcache-manager",
            "ctxcache-redis",
            "ctxcache-sidecar",
            "ctxcache-worker",
        }
    )


def test_every_vllm_metric_queried_is_one_the_installed_vllm_defines() -> None:
    """Against the installed vLLM's source (its Prometheus logger) and the connector's
    counters; a real vLLM's /metrics is checked in tests/vllm_connector (slow)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    loggers = Path(spec.origin).parent / "v1" / "metrics" / "loggers.py"
    defined = vllm_names_from_source(loggers, COUNTERS)
    assert "vllm:num_requests_running" in defined  # the source is read at all
    missing = {
        name: sorted(where)
        for name, where in queried_metrics().items()
        if name.startswith("vllm:") and name not in defined
    }
    assert not missing, missing


def test_the_exposition_reader_knows_declared_families() -> None:
    registry = CollectorRegistry()
    Counter("x_evictions", "by tier", ["tier"], registry=registry)  # no child yet
    Histogram("x_seconds", "h", ["mode"], registry=registry)
    declared = exposed_names(generate_latest(registry).decode())
    assert {"x_evictions_total", "x_seconds_bucket", "x_seconds_count"} <= declared
    assert "x_evictions_total_total" not in declared and "x_evictions" not in declared
    text = (
        "# HELP a_refused PUTs refused\n# TYPE a_refused counter\n"
        '# TYPE h histogram\nh_bucket{le="1"} 0\ng{x="y"} 1\n'
    )
    assert {"a_refused_total", "h_bucket", "h_count", "g"} <= exposed_names(text)
    assert "a_refused" not in exposed_names(text)
    assert not SYNTHETIC & exposed_names(text)
