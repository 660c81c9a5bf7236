"""Redis' own metrics: redis_exporter beside Redis in compose (profile monitoring) and in
the Kubernetes overlays, scraped as job ctxcache-redis, and the dashboard reading only
series that exporter serves."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.manifests import OVERLAYS, find, interpolate, load_compose, render
from tests.deploy.monitoring import MONITORING, queried_metrics

IMAGE = "oliver006/redis_exporter:v1.67.0-alpine"
# what that exporter serves (namespace `redis`), from its exporter/exporter.go
# (metricMapGauges, metricMapCounters, the descriptions): the ones worth a panel
EXPORTED = {
    "redis_up",
    "redis_memory_used_bytes",
    "redis_memory_used_rss_bytes",
    "redis_memory_max_bytes",
    "redis_connected_clients",
    "redis_blocked_clients",
    "redis_commands_processed_total",
    "redis_rejected_connections_total",
    "redis_evicted_keys_total",
    "redis_expired_keys_total",
    "redis_keyspace_hits_total",
    "redis_keyspace_misses_total",
    "redis_db_keys",
    "redis_aof_last_write_status",
    "redis_connected_slaves",
}


def test_compose_runs_the_exporter_with_the_monitoring_profile_only() -> None:
    services = load_compose()["services"]
    exporter = services["redis-exporter"]
    assert exporter["profiles"] == ["monitoring"]
    assert exporter["image"].startswith("${CTXCACHE_REDIS_EXPORTER_IMAGE:-")  # a mirror's
    assert interpolate(exporter["image"]) == IMAGE
    assert exporter["environment"]["REDIS_ADDR"] == "redis://redis:6379"
    assert exporter["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert "ports" not in exporter  # Prometheus reaches it on the compose network
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    assert jobs["ctxcache-redis"]["static_configs"][0]["targets"] == ["redis-exporter:9121"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_redis_pod_carries_the_exporter(overlay: str) -> None:
    pod = find(render(overlay), "StatefulSet", "redis")["spec"]["template"]["spec"]
    exporter = next(c for c in pod["containers"] if c["name"] == "redis-exporter")
    assert exporter["image"] == IMAGE
    assert {e["name"]: e["value"] for e in exporter["env"]} == {
        "REDIS_ADDR": "redis://localhost:6379"
    }
    assert exporter["ports"] == [{"name": "metrics", "containerPort": 9121}]
    assert exporter["securityContext"]["allowPrivilegeEscalation"] is False
    assert "memory" in exporter["resources"]["limits"]
    # Prometheus keeps the redis pods' `metrics` port as job ctxcache-redis
    k8s = yaml.safe_load((MONITORING / "prometheus-k8s.yml").read_text())
    job = next(j for j in k8s["scrape_configs"] if j["job_name"] == "ctxcache-redis")
    assert any(r.get("regex") == "redis;metrics" for r in job["relabel_configs"])


def test_the_dashboard_reads_only_what_the_exporter_serves() -> None:
    queried = {n: w for n, w in queried_metrics().items() if n.startswith("redis_")}
    assert queried, "the dashboard shows Redis"
    unknown = {n: sorted(w) for n, w in queried.items() if n not in EXPORTED}
    assert not unknown, unknown
