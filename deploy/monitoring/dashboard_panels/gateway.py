"""The gateway's rows: traffic, latency (session turns vs plain requests), sessions
and cache, implicit sessions.
"""

from __future__ import annotations

from typing import Any

from dashboard_panels.panel import percentiles, row, timeseries
from dashboard_panels.promql import quantile, rate, sel, share, total

GW_REQ = "ctxcache_gateway_requests_total"
IMPLICIT = "ctxcache_gateway_implicit_total"
SERVED = 'result=~"hit|branch|shared|miss"'  # the requests served as an implicit session's turn
API = 'route=~"/v1/.*"'  # the API's routes: not /health, /ready, /metrics
FAILED = 'status=~"5.."'


def panels() -> list[Any]:
    return [
        row("Traffic"),
        timeseries(
            "Requests by route and status",
            "Requests per second through the gateway, by route template and HTTP status "
            "(requests refused by a rate limit: the next panel).",
            "reqps",
            (total(GW_REQ, by="route, status"), "{{route}} {{status}}"),
        ),
        timeseries(
            "Error ratio (5xx) by API route",
            "Share of API requests (/v1/...) answered 5xx: worker or store failures (4xx are "
            "the client's; /health, /ready and /metrics are left out: /ready answers 503 "
            "whenever a part is down). Alert CtxcacheHighErrorRate.",
            "percentunit",
            (
                f"(sum by (route) ({rate(GW_REQ, FAILED, API)})"
                f" or 0 * sum by (route) ({rate(GW_REQ, API)}))"
                f" / (sum by (route) ({rate(GW_REQ, API)}) > 0)",
                "{{route}}",
            ),
        ),
        timeseries(
            "Rate-limited requests and limit-store errors",
            "Requests refused with 429 by the limit reached (requests, tokens; too_large: "
            "over the whole tpm budget), per tenant with the metrics token; and rate-limit "
            "calls the store could not answer: open = served uncounted, closed = refused "
            "with 503, settle = a reservation left as it was.",
            "reqps",
            (total("ctxcache_gateway_rate_limited_total", by="limit"), "429 {{limit}}"),
            (
                total("ctxcache_tenant_rate_limited_total", by="tenant, limit"),
                "429 {{tenant}} {{limit}}",
            ),
            (
                total("ctxcache_gateway_rate_limit_store_errors_total", by="outcome"),
                "store error: {{outcome}}",
            ),
        ),
        row("Latency: session turns vs plain requests"),
        timeseries(
            "TTFT (streamed)",
            "Time to first token as the gateway sees it, p50/p95/p99, session turns vs plain "
            "requests, streamed answers only: an answer not streamed shows its first token "
            "with its last (see End-to-end). Alert CtxcacheSlowTTFT.",
            "s",
            *percentiles(
                "ctxcache_gateway_ttft_seconds_bucket",
                "mode",
                "{{mode}}",
                (0.5, 0.95, 0.99),
                'stream!="false"',
            ),
        ),
        timeseries(
            "End-to-end completion time",
            "Whole completion, p50/p95/p99: a session turn's load, tokenize, generate and "
            "commit; a plain request's worker call.",
            "s",
            *percentiles(
                "ctxcache_gateway_completion_seconds_bucket", "mode", "{{mode}}", (0.5, 0.95, 0.99)
            ),
        ),
        timeseries(
            "Request latency p95 by route",
            "Every route, p95, as the gateway's middleware times it.",
            "s",
            (quantile(0.95, "ctxcache_gateway_request_seconds_bucket", "route"), "{{route}}"),
        ),
        row("Sessions and cache"),
        timeseries(
            "Cached-token ratio",
            "Share of prompt tokens whose KV was reused instead of recomputed "
            "(usage.prompt_tokens_details.cached_tokens over prompt_tokens).",
            "percentunit",
            (
                share(
                    total("ctxcache_gateway_cached_tokens_total"),
                    total("ctxcache_gateway_prompt_tokens_total"),
                ),
                "cached / prompt",
            ),
        ),
        timeseries(
            "Live sessions by tenant",
            "Sessions alive in the store, all tenants (/metrics) and per configured tenant "
            "(/metrics/tenants, with the metrics token), read from the store at each scrape "
            "(every gateway reads the same store: the max, not the sum).",
            "short",
            (f"max({sel('ctxcache_live_sessions')})", "all tenants"),
            (f"max by (tenant) ({sel('ctxcache_tenant_live_sessions')})", "{{tenant}}"),
        ),
        timeseries(
            "Turns by tenant",
            "Session turns committed per second, by tenant and kind (/metrics/tenants, with "
            "the metrics token).",
            "ops",
            (total("ctxcache_tenant_turns_total", by="tenant, kind"), "{{tenant}} {{kind}}"),
        ),
        row("Implicit sessions: clients that resend the conversation"),
        timeseries(
            "Implicit sessions by result",
            "Chat requests without a session per second, by what implicit sessions made of "
            "them (docs/implicit.md): hit (a turn of the conversation's latest state), branch "
            "(a fork of an older state), shared (a new conversation forked from another's "
            "shared prefix), miss (a new conversation), passed (passed through as "
            "it is: implicit sessions off, or a request that cannot be a turn). unkept counts "
            "the served requests whose state could not be kept (the tenant's "
            "quota full of explicit sessions, the store failing): their next request misses.",
            "reqps",
            (total(IMPLICIT, by="result"), "{{result}}"),
        ),
        timeseries(
            "Implicit hit ratio",
            "Of the requests served as implicit turns (hit, branch, shared, miss), the share "
            "that continued what the gateway kept (a conversation: hit or branch; another's "
            "prefix: shared), and the share whose "
            "new state was not kept (unkept; alert CtxcacheImplicitStatesUnkept). Passed-"
            "through requests are left out.",
            "percentunit",
            (
                share(total(IMPLICIT, 'result=~"hit|branch|shared"'), total(IMPLICIT, SERVED)),
                "hit + branch + shared",
            ),
            (share(total(IMPLICIT, 'result="unkept"'), total(IMPLICIT, SERVED)), "unkept"),
        ),
        timeseries(
            "Cached tokens by kind",
            "Prompt tokens per second whose KV was reused, by kind: explicit (session turns), "
            "implicit (implicit sessions' hits and branches), shared (a new conversation's "
            "prefix: another conversation's forked, or one the engine's own cache had).",
            "short",
            (total("ctxcache_gateway_cached_tokens_by_kind_total", by="kind"), "{{kind}}"),
        ),
    ]
