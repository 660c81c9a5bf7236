"""Prometheus metrics of one gateway (its own registry: no globals, no tenant labels)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)


class GatewayMetrics:
    def __init__(self) -> None:
        self._series: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ctxcache_gateway_requests_total",
            "requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "ctxcache_gateway_request_seconds",
            "request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ctxcache_gateway_ttft_seconds",
            "time to the first generated token (or the whole response)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ctxcache_gateway_prompt_tokens_total", "prompt tokens attended to", registry=r
        )
        self.cached_tokens = Counter(
            "ctxcache_gateway_cached_tokens_total", "prompt tokens whose KV was reused", registry=r
        )
        self.relayed_streams = Counter(
            "ctxcache_gateway_relayed_streams_total",
            "streams without a session taken by the relay (gateway/relay.py); one whose "
            "worker could not be reached is then answered the regular way",
            registry=r,
        )
        self.sessions_created = Counter(
            "ctxcache_gateway_sessions_created_total",
            "sessions created through this gateway",
            registry=r,
        )
        self.sessions_deleted = Counter(
            "ctxcache_gateway_sessions_deleted_total",
            "sessions deleted through this gateway",
            registry=r,
        )
        self.live_sessions = Gauge(
            "ctxcache_live_sessions", "live sessions, every tenant", registry=r
        )
        self.worker_inflight = Gauge(
            "ctxcache_gateway_worker_inflight",
            "requests in flight per worker",
            ["worker"],
            registry=r,
        )
        self.worker_healthy = Gauge(
            "ctxcache_gateway_worker_healthy", "1 if healthy", ["worker"], registry=r
        )
        self.idempotent_replays = Counter(
            "ctxcache_gateway_idempotent_replays_total",
            "requests answered with the recorded answer of their Idempotency-Key",
            registry=r,
        )
        self.turn_lock_renewals = Counter(
            "ctxcache_gateway_turn_lock_renewals_total",
            "turn locks extended because their turn ran longer than a third of the lock TTL",
            registry=r,
        )

    def replayed(self, tenant: str) -> None:
        """(per tenant: in the tenant registry of issue 25's rate limits, once merged)"""
        self.idempotent_replays.inc()

    def observe(self, route: str, status: int, seconds: float) -> None:
        # the labelled series, looked up once per (route, status): both are bounded sets
        series = self._series.get((route, status))
        if series is None:
            series = (self.requests.labels(route, str(status)), self.latency.labels(route))
            self._series[(route, status)] = series
        series[0].inc()
        series[1].observe(seconds)

    def tokens(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.cached_tokens.inc((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
