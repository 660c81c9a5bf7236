"""Prometheus metrics of one manager, in a registry of its own (no process globals).

No label names a tenant, a session or a key: route templates and statuses only, so
`/metrics` needs no token (like `/health`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ctxcache.metrics import process_collectors

# the manager answers in milliseconds; a Redis failover or a slow WAIT takes seconds
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ManagerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        process_collectors(r)
        self.requests = Counter(
            "ctxcache_manager_requests_total",
            "requests by route template and status",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "ctxcache_manager_request_seconds",
            "request latency by route template",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.store_up = Gauge(
            "ctxcache_manager_store_up",
            "1 if the manager's Redis answered a PING at the last scrape",
            registry=r,
        )

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self, store_up: bool) -> bytes:
        self.store_up.set(1 if store_up else 0)
        return generate_latest(self.registry)
