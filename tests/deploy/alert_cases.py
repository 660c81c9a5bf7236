"""What each alert of deploy/monitoring/alerts.yml must do, as series for `promtool test
rules`: cases where it must fire (with the labels it carries), and the cases that must not
page. Series are sampled every minute; `counter(...)` and `histogram(...)` write them in
promtool's expanding notation (`a+bxN`: N+1 samples from a, b apart)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics

Series = tuple[str, str]  # (series selector, values)

GW = {"job": "ctxcache-gateway", "instance": "gw-0:8000"}
SIDECAR = {"job": "ctxcache-sidecar", "instance": "worker-0:8200"}
VLLM = {"job": "ctxcache-worker", "instance": "worker-0:8100", "model_name": "m", "engine": "0"}


@dataclass
class Case:
    alert: str
    name: str  # what happens, as the test id says it
    series: list[Series]
    at: str  # when promtool looks (e.g. "20m")
    fires: dict[str, str] | None = None  # the alert's labels when it must fire; None: quiet


def _labels(labels: dict[str, str]) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def series(name: str, labels: dict[str, str], values: str) -> Series:
    return f"{name}{_labels(labels)}", values


def counter(name: str, labels: dict[str, str], per_minute: float, minutes: int) -> Series:
    """A counter growing `per_minute` for `minutes` minutes, from 0."""
    return series(name, labels, f"0+{per_minute:g}x{minutes}")


@cache
def bucket_edges(metric: str) -> tuple[float, ...]:
    """The `le` edges of one of the gateway's histograms, as the code declares them."""
    registry: CollectorRegistry = GatewayMetrics().registry
    edges = {
        float(sample.labels["le"])
        for family in registry.collect()
        if family.name == metric
        for sample in family.samples
        if sample.name == f"{metric}_bucket"
    }
    return tuple(sorted(edges))


def histogram(
    metric: str, labels: dict[str, str], per_minute: dict[float, int], minutes: int
) -> list[Series]:
    """The bucket series of the gateway's histogram `metric` (its real edges) receiving
    `per_minute[seconds]` observations of `seconds` each minute."""
    out = []
    for le in [*bucket_edges(metric), float("inf")]:
        n = sum(count for seconds, count in per_minute.items() if seconds <= le)
        edge = "+Inf" if le == float("inf") else f"{le:g}"
        out.append(counter(f"{metric}_bucket", {**labels, "le": edge}, n, minutes))
    return out


def _requests(route: str, status: int, per_minute: int, **more: str) -> Series:
    labels = {**GW, "route": route, "status": str(status), **more}
    return counter("ctxcache_gateway_requests_total", labels, per_minute, 30)


def _ttft(mode: str, stream: str, per_minute: dict[float, int]) -> list[Series]:
    labels = {**GW, "mode": mode, "stream": stream}
    return histogram("ctxcache_gateway_ttft_seconds", labels, per_minute, 30)


def _up(job: str, instance: str, values: str) -> Series:
    return series("up", {"job": job, "instance": instance}, values)


def _rate_limit(outcome: str, per_minute: int) -> Series:
    name = "ctxcache_gateway_rate_limit_store_errors_total"
    return counter(name, {**GW, "outcome": outcome}, per_minute, 30)


def _refused(reason: str, values: str) -> Series:
    return series("ctxcache_sidecar_refused_blocks_total", {**SIDECAR, "reason": reason}, values)


def _sidecar(pinned: int, memory: int, disk: int) -> list[Series]:
    return [
        series("ctxcache_sidecar_pinned_bytes", SIDECAR, f"{pinned}x30"),
        series("ctxcache_sidecar_memory_bytes_budget", SIDECAR, f"{memory}x30"),
        series("ctxcache_sidecar_disk_bytes_budget", SIDECAR, f"{disk}x30"),
    ]


def _connector(**per_minute: int) -> list[Series]:
    return [counter(f"vllm:ctxcache_{k}_total", VLLM, n, 40) for k, n in per_minute.items()]


DAY = 1440  # minutes


def _tokens(cached: str) -> list[Series]:
    """A day and a half of 1,000 prompt tokens a minute, `cached` of them reused."""
    return [
        series("ctxcache_gateway_prompt_tokens_total", GW, f"0+1000x{DAY + 120}"),
        series("ctxcache_gateway_cached_tokens_total", GW, cached),
    ]


def _engine(usage: float, waiting: int) -> list[Series]:
    return [
        series("vllm:kv_cache_usage_perc", VLLM, f"{usage:g}x40"),
        series("vllm:num_requests_waiting", VLLM, f"{waiting}x40"),
    ]


def _implicit(**per_minute: int) -> list[Series]:
    """The gateway's implicit requests, `per_minute[result]` a minute for 40 minutes."""
    name = "ctxcache_gateway_implicit_total"
    return [counter(name, {**GW, "result": r}, n, 40) for r, n in per_minute.items()]


PAGE, WARNING = {"severity": "page"}, {"severity": "warning"}
GW_JOB = {"job": GW["job"]}

CASES = [
    # -- CtxcacheHighErrorRate -----------------------------------------------------------
    Case(
        "CtxcacheHighErrorRate",
        "fires-api-5xx",
        [_requests("/v1/completions", 200, 60), _requests("/v1/completions", 500, 10)],
        "20m",
        {**GW_JOB, **PAGE},
    ),
    Case(
        "CtxcacheHighErrorRate",
        "fires-for-the-one-deployment-failing",  # not diluted by a busy healthy one
        [
            _requests("/v1/completions", 200, 60, namespace="a"),
            _requests("/v1/completions", 500, 10, namespace="a"),
            _requests("/v1/completions", 200, 6000, namespace="b"),
        ],
        "20m",
        {"namespace": "a", **GW_JOB, **PAGE},
    ),
    Case(
        "CtxcacheHighErrorRate",
        "quiet-probes-and-scrapes-failing",  # /ready is 503 while the store is down
        [
            _requests("/v1/completions", 200, 60),
            _requests("/ready", 503, 12),
            _requests("/health", 500, 6),
            _requests("/metrics", 500, 4),
        ],
        "20m",
    ),
    Case(
        "CtxcacheHighErrorRate",
        "quiet-client-errors",
        [_requests("/v1/completions", 200, 60), _requests("/v1/completions", 429, 30)],
        "20m",
    ),
    # -- CtxcacheSlowTTFT -----------------------------------------------------------------
    Case(
        "CtxcacheSlowTTFT",
        "fires-streamed-turns-slow-to-start",
        _ttft("session", "true", {3.0: 60}),
        "25m",
        {**GW_JOB, **PAGE},
    ),
    Case(
        "CtxcacheSlowTTFT",
        "quiet-long-non-streamed-answers",
        [
            *_ttft("session", "true", {0.4: 60}),
            *_ttft("session", "false", {30.0: 60}),
            *_ttft("plain", "true", {8.0: 60}),  # (a plain request may carry any prompt)
        ],
        "25m",
    ),
    Case(
        "CtxcacheSlowTTFT",
        "quiet-p95-just-under-the-2s-edge",  # an edge at 2 s tells 1.8 s from 2.3 s
        _ttft("session", "true", {1.8: 96, 2.3: 4}),
        "25m",
    ),
    # -- CtxcacheStoreUnavailable ---------------------------------------------------------
    Case(
        "CtxcacheStoreUnavailable",
        "fires-store-down",
        [series("ctxcache_gateway_store_up", GW, "1 1 0x10")],
        "8m",
        {**GW, **PAGE},
    ),
    Case(
        "CtxcacheStoreUnavailable",
        "quiet-one-failed-scrape",
        [series("ctxcache_gateway_store_up", GW, "1 1 0 1x10")],
        "8m",
    ),
    # -- CtxcacheNoHealthyWorker ----------------------------------------------------------
    Case(
        "CtxcacheNoHealthyWorker",
        "fires-every-worker-failing",
        [
            series("ctxcache_gateway_worker_healthy", {**GW, "worker": "w0"}, "0x10"),
            series("ctxcache_gateway_worker_healthy", {**GW, "worker": "w1"}, "0x10"),
        ],
        "5m",
        {**GW, **PAGE},
    ),
    Case(
        "CtxcacheNoHealthyWorker",
        "quiet-one-worker-left",
        [
            series("ctxcache_gateway_worker_healthy", {**GW, "worker": "w0"}, "0x10"),
            series("ctxcache_gateway_worker_healthy", {**GW, "worker": "w1"}, "1x10"),
        ],
        "5m",
    ),
    # -- CtxcacheTargetDown ---------------------------------------------------------------
    Case(
        "CtxcacheTargetDown",
        "fires-sidecar-unreachable",
        [_up("ctxcache-sidecar", SIDECAR["instance"], "0x10")],
        "5m",
        {"job": "ctxcache-sidecar", "instance": SIDECAR["instance"], **PAGE},
    ),
    Case(
        "CtxcacheTargetDown",
        "quiet-tenant-endpoint-without-token",  # the install without a metrics token
        [
            _up("ctxcache-gateway", GW["instance"], "1x10"),
            _up("ctxcache-gateway-tenants", GW["instance"], "0x10"),
        ],
        "5m",
    ),
    # -- CtxcacheRateLimitMisconfigured ---------------------------------------------------
    Case(
        "CtxcacheRateLimitMisconfigured",
        "fires-manager-refuses-the-gateway",
        [_rate_limit("misconfigured", 5)],
        "10m",
        {**GW, **PAGE},
    ),
    Case(
        "CtxcacheRateLimitMisconfigured",
        "quiet-store-outage-served-open",
        [_rate_limit("open", 30)],
        "10m",
    ),
    # -- CtxcacheTenantMetricsUnscraped ---------------------------------------------------
    Case(
        "CtxcacheTenantMetricsUnscraped",
        "fires-gateway-up-tenants-refused",
        [
            _up("ctxcache-gateway", GW["instance"], "1x20"),
            _up("ctxcache-gateway-tenants", GW["instance"], "0x20"),
        ],
        "15m",
        {"job": "ctxcache-gateway-tenants", "instance": GW["instance"], **WARNING},
    ),
    Case(
        "CtxcacheTenantMetricsUnscraped",
        "quiet-gateway-down-too",  # (CtxcacheTargetDown pages for that)
        [
            _up("ctxcache-gateway", GW["instance"], "0x20"),
            _up("ctxcache-gateway-tenants", GW["instance"], "0x20"),
        ],
        "15m",
    ),
    # -- CtxcacheSidecarRefusing ----------------------------------------------------------
    Case(
        "CtxcacheSidecarRefusing",
        "fires-pin-budget-full",
        [_refused("pin_budget", "0+30x40")],
        "30m",
        {**SIDECAR, **WARNING},
    ),
    Case(
        "CtxcacheSidecarRefusing",
        "quiet-a-single-refusal",
        [_refused("pin_budget", "0 1x40")],
        "30m",
    ),
    Case(
        "CtxcacheSidecarRefusing",
        "quiet-too-large-is-not-capacity",
        [_refused("too_large", "0+30x40")],
        "30m",
    ),
    # -- CtxcacheSidecarBlockTooLarge -----------------------------------------------------
    Case(
        "CtxcacheSidecarBlockTooLarge",
        "fires-one-block-too-large",
        [_refused("too_large", "1x10")],
        "5m",
        {**SIDECAR, **WARNING},
    ),
    Case(
        "CtxcacheSidecarBlockTooLarge",
        "quiet-capacity-refusals",
        [_refused("pin_budget", "0+30x10"), _refused("disk_full", "0+30x10")],
        "5m",
    ),
    # -- CtxcacheSidecarPinsNearlyFull ----------------------------------------------------
    Case(
        "CtxcacheSidecarPinsNearlyFull",
        "fires-pins-fill-the-budget",
        _sidecar(pinned=95, memory=60, disk=40),
        "20m",
        {**SIDECAR, **WARNING},
    ),
    Case(
        "CtxcacheSidecarPinsNearlyFull",
        "quiet-no-disk-tier-half-pinned",
        _sidecar(pinned=50, memory=100, disk=0),
        "20m",
    ),
    # -- CtxcacheSidecarCorruptBlocks -----------------------------------------------------
    Case(
        "CtxcacheSidecarCorruptBlocks",
        "fires-a-corrupt-block",
        [series("ctxcache_sidecar_corrupt_blocks_total", SIDECAR, "0 0 0 1x10")],
        "8m",
        {**SIDECAR, **WARNING},
    ),
    Case(
        "CtxcacheSidecarCorruptBlocks",
        "quiet-none",
        [series("ctxcache_sidecar_corrupt_blocks_total", SIDECAR, "0x10")],
        "8m",
    ),
    # -- CtxcacheConnectorLoadsFailing ----------------------------------------------------
    Case(
        "CtxcacheConnectorLoadsFailing",
        "fires-a-fifth-of-loads-failing",
        _connector(loads=60, load_failures=12),
        "30m",
        {"job": VLLM["job"], "instance": VLLM["instance"], **WARNING},
    ),
    Case(
        "CtxcacheConnectorLoadsFailing",
        "quiet-a-few-misses",
        _connector(loads=60, load_failures=3),
        "30m",
    ),
    Case(
        "CtxcacheConnectorLoadsFailing",
        "quiet-no-loads",
        _connector(loads=0, load_failures=0),
        "30m",
    ),
    # -- CtxcacheConnectorStoresDropped ---------------------------------------------------
    Case(
        "CtxcacheConnectorStoresDropped",
        "fires-a-fifth-of-stores-dropped",
        _connector(lookups=60, store_drops=12),
        "30m",
        {"job": VLLM["job"], "instance": VLLM["instance"], **WARNING},
    ),
    Case(
        "CtxcacheConnectorStoresDropped",
        "quiet-a-drop-now-and-then",
        _connector(lookups=60, store_drops=1),
        "30m",
    ),
    # -- CtxcacheCachedTokenRatioFalling --------------------------------------------------
    Case(
        "CtxcacheCachedTokenRatioFalling",
        "fires-ratio-falls-from-80-to-20-percent",
        _tokens(f"0+800x{DAY} {800 * DAY + 200}+200x119"),
        f"{DAY + 90}m",
        {**GW_JOB, **WARNING},
    ),
    Case(
        "CtxcacheCachedTokenRatioFalling",
        "quiet-steady-ratio",
        _tokens(f"0+800x{DAY + 120}"),
        f"{DAY + 90}m",
    ),
    Case(
        "CtxcacheCachedTokenRatioFalling",
        "quiet-always-low",  # a workload with little reuse has not fallen
        _tokens(f"0+100x{DAY + 120}"),
        f"{DAY + 90}m",
    ),
    # -- CtxcacheEngineKVSaturated --------------------------------------------------------
    Case(
        "CtxcacheEngineKVSaturated",
        "fires-kv-full-and-requests-waiting",
        _engine(usage=0.97, waiting=3),
        "30m",
        {"job": VLLM["job"], "instance": VLLM["instance"], **WARNING},
    ),
    Case(
        "CtxcacheEngineKVSaturated",
        "quiet-kv-full-nothing-waiting",
        _engine(usage=0.97, waiting=0),
        "30m",
    ),
    Case(
        "CtxcacheEngineKVSaturated",
        "quiet-waiting-with-kv-to-spare",
        _engine(usage=0.5, waiting=4),
        "30m",
    ),
    # -- CtxcacheRateLimitFailingOpen -----------------------------------------------------
    Case(
        "CtxcacheRateLimitFailingOpen",
        "fires-store-errors-served-uncounted",
        [_rate_limit("open", 10)],
        "15m",
        {**GW, **WARNING},
    ),
    Case(
        "CtxcacheRateLimitFailingOpen",
        "quiet-failing-closed-or-settling",
        [_rate_limit("closed", 10), _rate_limit("settle", 10)],
        "15m",
    ),
    # -- CtxcacheImplicitStatesUnkept ----------------------------------------------------
    Case(
        "CtxcacheImplicitStatesUnkept",
        "fires-a-fifth-of-states-unkept",  # (a tenant's quota full of explicit sessions)
        _implicit(hit=40, branch=5, miss=15, unkept=12, passed=0),
        "30m",
        {**GW_JOB, **WARNING},
    ),
    Case(
        "CtxcacheImplicitStatesUnkept",
        "quiet-a-few-unkept",
        _implicit(hit=40, branch=5, miss=15, unkept=3, passed=0),
        "30m",
    ),
    Case(
        "CtxcacheImplicitStatesUnkept",
        "quiet-passed-through-traffic-keeps-no-state",  # not the denominator, not unkept
        _implicit(hit=0, branch=0, miss=0, unkept=0, passed=600),
        "30m",
    ),
    Case(
        "CtxcacheImplicitStatesUnkept",
        # nothing kept for four minutes (a store outage: CtxcacheStoreUnavailable pages for
        # it), then all again: over 10% for 11 minutes of the rate's window, not the 15
        # of `for` (looked at on the last of them)
        "quiet-a-store-outage-of-minutes",
        [
            *_implicit(hit=40, branch=5, miss=15, passed=0),
            series(
                "ctxcache_gateway_implicit_total", {**GW, "result": "unkept"}, "0x12 60+60x3 240x25"
            ),
        ],
        "24m",
    ),
]
