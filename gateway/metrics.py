"""Prometheus metrics of one gateway (its own registry: no globals, no tenant labels).

The per-tenant counters (`TenantMetrics`) are a second registry, served only to a caller
with the metrics token (`GET /metrics/tenants`): `/metrics` is reachable by anyone who
can reach the API port, and must not tell one tenant the names of the others."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ctxcache.metrics import process_collectors

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
    2,  # the TTFT alert's threshold and SLO (deploy/monitoring/alerts.yml): an exact edge
    2.5,
    5,
    10,
    30,
    60,
    120,
)


MODES = ("session", "plain")  # the `mode` label: a session turn, or a request without one


class GatewayMetrics:
    def __init__(self) -> None:
        self._series: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        process_collectors(r)  # RSS, CPU, open fds (not in the tenants' registry)
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
            "time from the request to its first generated token, session turns (from "
            'loading the session) vs plain requests; stream="false": an answer not streamed, '
            "whose first token the gateway sees only with the whole answer",
            ["mode", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.completion_seconds = Histogram(
            "ctxcache_gateway_completion_seconds",
            "end-to-end completion time, session turns (load, tokenize, generate, commit) "
            "vs plain requests",
            ["mode"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._ttft = {
            (mode, streamed): self.ttft.labels(mode, str(streamed).lower())
            for mode in MODES
            for streamed in (True, False)
        }
        self._e2e = {mode: self.completion_seconds.labels(mode) for mode in MODES}
        self.turns = Counter(
            "ctxcache_gateway_turns_total",
            "session turns committed, by kind (chat, completion; per tenant: "
            "ctxcache_tenant_turns_total)",
            ["kind"],
            registry=r,
        )
        self.store_up = Gauge(
            "ctxcache_gateway_store_up",
            "1 if the session store (the manager and its Redis) answered at the last scrape",
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
            "streams without a session passed through as the worker sent them",
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
        self.rate_limited = Counter(
            "ctxcache_gateway_rate_limited_total",
            "requests refused with 429 rate_limit_exceeded, by the limit reached "
            "(requests, tokens; too_large: a request over the whole tpm budget)",
            ["limit"],
            registry=r,
        )
        self.rate_limit_store_errors = Counter(
            "ctxcache_gateway_rate_limit_store_errors_total",
            "rate-limit calls the store could not answer, by what happened: open (served "
            "uncounted), closed (refused with 503), settle (a reservation left as it was)",
            ["outcome"],
            registry=r,
        )
        self.idempotent_replays = Counter(
            "ctxcache_gateway_idempotent_replays_total",
            "requests answered with the recorded answer of their Idempotency-Key "
            "(per tenant: ctxcache_tenant_idempotent_replays_total)",
            registry=r,
        )
        self.cancellations = Counter(
            "ctxcache_gateway_cancellations_total",
            "requests dropped because their client left before the answer was complete "
            "(the worker's request cancelled; per tenant: ctxcache_tenant_cancellations_total)",
            registry=r,
        )
        self.tool_rerenders = Counter(
            "ctxcache_gateway_tool_rerenders_total",
            "session turns whose tools differed from the session's: the whole conversation "
            "was rendered again with them as a new prefix, its KV recomputed (docs/agents.md)",
            registry=r,
        )
        self.reasoning_rebases = Counter(
            "ctxcache_gateway_reasoning_rebases_total",
            "session turns that closed a user turn whose stored ids the chat template renders "
            "otherwise (its reasoning dropped): the session re-based on the template's "
            "rendering (docs/reasoning.md)",
            registry=r,
        )
        self.reasoning_rebase_tokens = Counter(
            "ctxcache_gateway_reasoning_rebase_tokens_total",
            "prompt tokens of re-based turns from the first difference with the stored ids "
            "on (the closed turn rendered again, and the new input): what the engine computes",
            registry=r,
        )
        self.tool_calls = Counter(
            "ctxcache_gateway_tool_calls_total",
            "tool calls answered by session turns (parsed by the engine's tool parser)",
            registry=r,
        )
        self.turn_lock_renewals = Counter(
            "ctxcache_gateway_turn_lock_renewals_total",
            "turn locks extended because their turn ran longer than a third of the lock TTL",
            registry=r,
        )
        self.implicit_requests = Counter(
            "ctxcache_gateway_implicit_total",
            "chat requests without a session, by what implicit sessions made of them: hit "
            "(a turn of the conversation's latest state), branch (a fork of an older one), "
            "shared (a new conversation forked from another's shared prefix), "
            "miss (a new conversation), passed (passed through as it is), unkept (answered, "
            "its state not kept) (docs/implicit.md)",
            ["result"],
            registry=r,
        )
        self.cached_by_kind = Counter(
            "ctxcache_gateway_cached_tokens_by_kind_total",
            "prompt tokens whose KV was reused, by kind: explicit (a session turn), implicit "
            "(an implicit session's hit or branch), shared (a new conversation's prefix "
            "another request already had)",
            ["kind"],
            registry=r,
        )
        for result in ("hit", "branch", "shared", "miss", "passed", "unkept"):
            self.implicit_requests.labels(result)
        for kind in ("explicit", "implicit", "shared"):
            self.cached_by_kind.labels(kind)
        self.tenants = TenantMetrics()

    def turn(self, tenant: str, kind: str) -> None:
        """A session turn committed."""
        self.turns.labels(kind).inc()
        self.tenants.turn(tenant, kind)

    def reasoning_rebase(self, tokens: int) -> None:
        """A turn committed re-based (`tokens` from the first difference on)."""
        self.reasoning_rebases.inc()
        self.reasoning_rebase_tokens.inc(tokens)

    def replayed(self, tenant: str) -> None:
        self.idempotent_replays.inc()
        self.tenants.replayed(tenant)

    def cancelled(self, tenant: str) -> None:
        self.cancellations.inc()
        self.tenants.cancelled(tenant)

    def observe(self, route: str, status: int, seconds: float) -> None:
        # the labelled series, looked up once per (route, status): both are bounded sets
        series = self._series.get((route, status))
        if series is None:
            series = (self.requests.labels(route, str(status)), self.latency.labels(route))
            self._series[(route, status)] = series
        series[0].inc()
        series[1].observe(seconds)

    def first_token(self, mode: str, seconds: float, *, streamed: bool) -> None:
        """Time to the first token of a completion: `mode` is "session" or "plain" (a
        request without a session). Streamed, it is when the first token reaches the
        gateway (a stream without a session: its first bytes, which
        `gateway.completions.streams.relayed` passes on as they come); not streamed, only
        the whole answer shows it, so it is labelled `stream="false"` and kept out of the
        TTFT alert."""
        self._ttft[mode, streamed].observe(seconds)

    def completed(self, mode: str, seconds: float) -> None:
        """A completion's end-to-end time (`mode` as `first_token`)."""
        self._e2e[mode].observe(seconds)

    def tokens(self, usage: dict[str, Any]) -> None:
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.cached_tokens.inc((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

    def implicit(self, result: str) -> None:
        self.implicit_requests.labels(result).inc()

    def cached(self, kind: str, usage: dict[str, Any]) -> None:
        """A turn's reused prompt tokens, counted by kind (`cached_by_kind`)."""
        n = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self.cached_by_kind.labels(kind).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TenantMetrics:
    """Counters per tenant (a bounded set: the configured keys' tenants)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            "ctxcache_tenant_requests_total",
            "requests under /v1/ by keys with limits (all keys with a metrics token)",
            ["tenant"],
            registry=r,
        )
        self._tokens = Counter(
            "ctxcache_tenant_tokens_total",
            "tokens charged: answers' usage.total_tokens (a stream without usage: its reservation)",
            ["tenant"],
            registry=r,
        )
        self._limited = Counter(
            "ctxcache_tenant_rate_limited_total",
            "requests refused with 429 rate_limit_exceeded, by the limit reached",
            ["tenant", "limit"],
            registry=r,
        )
        self._replays = Counter(
            "ctxcache_tenant_idempotent_replays_total",
            "requests answered with the recorded answer of their Idempotency-Key",
            ["tenant"],
            registry=r,
        )
        self._cancellations = Counter(
            "ctxcache_tenant_cancellations_total",
            "requests dropped because their client left before the answer was complete",
            ["tenant"],
            registry=r,
        )
        self._turns = Counter(
            "ctxcache_tenant_turns_total",
            "session turns committed, by kind (chat, completion)",
            ["tenant", "kind"],
            registry=r,
        )
        self.live_sessions = Gauge(
            "ctxcache_tenant_live_sessions",
            "live sessions of each configured tenant (read from the store at each scrape)",
            ["tenant"],
            registry=r,
        )

    def turn(self, tenant: str, kind: str) -> None:
        self._turns.labels(tenant, kind).inc()

    def replayed(self, tenant: str) -> None:
        self._replays.labels(tenant).inc()

    def cancelled(self, tenant: str) -> None:
        self._cancellations.labels(tenant).inc()

    def request(self, tenant: str) -> None:
        self._requests.labels(tenant).inc()

    def tokens(self, tenant: str, n: int) -> None:
        self._tokens.labels(tenant).inc(n)

    def limited(self, tenant: str, limit: str) -> None:
        self._limited.labels(tenant, limit).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
