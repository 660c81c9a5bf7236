"""The ctxcache Grafana dashboard as code: writes grafana/dashboards/ctxcache.json.

    .venv/bin/python deploy/monitoring/dashboard.py          # write the JSON
    .venv/bin/python deploy/monitoring/dashboard.py --check  # exit 1 if it is stale

Every selector goes through `sel`, which adds the dashboard's variables: `$namespace` and
`$job` (one deployment of several in one Prometheus), and `$model` on vLLM's series. So no
panel can forget them, and two deployments never add up. tests/deploy/test_dashboard.py
fails when the JSON differs from what this writes; docs/operations.md explains the panels.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "grafana" / "dashboards" / "ctxcache.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
# the variables' "All": every namespace (also series without one: compose, static
# configs), the jobs named like ctxcache's, every model
ALL_NAMESPACES, ALL_JOBS, ALL_MODELS = ".*", ".*ctxcache.*", ".*"


def sel(name: str, *matchers: str) -> str:
    """`name{matchers..., job=~"$job", namespace=~"$namespace"[, model_name=~"$model"]}`."""
    scope = ['job=~"$job"', 'namespace=~"$namespace"']
    if name.startswith("vllm:"):
        scope.append('model_name=~"$model"')
    return f"{name}{{{', '.join([*matchers, *scope])}}}"


def rate(name: str, *matchers: str) -> str:
    return f"rate({sel(name, *matchers)}{RATE})"


def total(name: str, *matchers: str, by: str = "") -> str:
    """The summed per-second rate of a counter (`by`: the labels kept)."""
    return f"sum{f' by ({by})' if by else ''} ({rate(name, *matchers)})"


def quantile(q: float, histogram: str, by: str = "", *matchers: str) -> str:
    keep = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({keep}) ({rate(histogram, *matchers)}))"


def share(part: str, whole: str) -> str:
    """`part / whole` where the whole is not 0: nothing (not NaN) in a window without any."""
    return f"{part} / on() group_left() ({whole} > 0)"


# ---- panels ---------------------------------------------------------------------------
Target = tuple[str, str]  # (expr, legend)


def timeseries(
    title: str, description: str, unit: str, *targets: Target, w: int = 8, h: int = 8
) -> Any:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": list(targets),
        "_w": w,
        "_h": h,
    }


def stat(title: str, description: str, target: Target, w: int = 6) -> Any:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "fieldConfig": {
            "defaults": {
                "unit": "short",
                "thresholds": {
                    "mode": "absolute",
                    "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}],
                },
            },
            "overrides": [],
        },
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": "auto",
        },
        "targets": [target],
        "_w": w,
        "_h": 6,
    }


def row(title: str) -> Any:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "_w": 24, "_h": 1}


def percentiles(
    histogram: str, by: str, label: str, qs: tuple[float, ...], *m: str
) -> list[Target]:
    return [(quantile(q, histogram, by, *m), f"p{round(q * 100, 1):g} {label}".strip()) for q in qs]


GW_REQ = "ctxcache_gateway_requests_total"
API = 'route=~"/v1/.*"'  # the API's routes: not /health, /ready, /metrics
FAILED = 'status=~"5.."'
HITS, MISSES = "ctxcache_sidecar_hits_total", "ctxcache_sidecar_misses_total"
SIDECAR_READS = f"(sum({rate(HITS)}) + sum({rate(MISSES)}))"
LOAD_BYTES = (
    f"(sum({rate('vllm:ctxcache_load_bytes_shm_total')})"
    f" + sum({rate('vllm:ctxcache_load_bytes_tcp_total')}))"
)
LOAD_SECONDS = (
    f"(sum({rate('vllm:ctxcache_load_us_shm_total')})"
    f" + sum({rate('vllm:ctxcache_load_us_tcp_total')})) / 1e6"
)
LOADS = total("vllm:ctxcache_loads_total")


def _bandwidth(path: str) -> str:
    seconds = f"sum({rate(f'vllm:ctxcache_load_us_{path}_total')}) / 1e6"
    return f"sum({rate(f'vllm:ctxcache_load_bytes_{path}_total')}) / ({seconds} > 0)"


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
        row("KV sidecar"),
        timeseries(
            "Memory and disk use",
            "Bytes used over budget per tier (no disk line without a disk tier), and pinned "
            "(live sessions') bytes over the whole pin budget (memory + disk). Pinned near "
            "100%: new sessions' blocks are refused (alert CtxcacheSidecarPinsNearlyFull).",
            "percentunit",
            (
                f"{sel('ctxcache_sidecar_memory_bytes_used')}"
                f" / {sel('ctxcache_sidecar_memory_bytes_budget')}",
                "memory {{instance}}",
            ),
            (
                f"{sel('ctxcache_sidecar_disk_bytes_used')}"
                f" / ({sel('ctxcache_sidecar_disk_bytes_budget')} > 0)",
                "disk {{instance}}",
            ),
            (
                f"{sel('ctxcache_sidecar_pinned_bytes')} / ("
                f"{sel('ctxcache_sidecar_memory_bytes_budget')}"
                f" + {sel('ctxcache_sidecar_disk_bytes_budget')})",
                "pinned {{instance}}",
            ),
        ),
        timeseries(
            "KV hit rate by tier",
            "Where prompt KV came from. vLLM: the share of its prompt tokens from its own "
            "prefix cache (local_cache_hit), from the sidecar through the ctxcache connector "
            "(external_kv_transfer), or computed (local_compute). Built-in worker: tokens "
            "reused from its own cache (l1) or the sidecar. Sidecar reads: blocks read from "
            "memory, from disk, or missed. An engine reads the sidecar only after its own "
            "cache missed, and vLLM's connector looks blocks up without reading them "
            "(EXISTS): its lookups are not sidecar misses, and the sidecar lines stay empty "
            "while nothing is loaded from it.",
            "percentunit",
            (
                share(
                    total("vllm:prompt_tokens_by_source_total", by="source"),
                    total("vllm:prompt_tokens_total"),
                ),
                "vLLM {{source}}",
            ),
            (
                share(
                    total("ctxcache_worker_cached_tokens_total", by="tier"),
                    total("ctxcache_worker_prompt_tokens_total"),
                ),
                "worker {{tier}}",
            ),
            (share(total(HITS, by="tier"), SIDECAR_READS), "sidecar reads {{tier}}"),
            (share(total(MISSES), SIDECAR_READS), "sidecar reads missed"),
        ),
        timeseries(
            "Evictions, refused and corrupt blocks",
            "Blocks evicted to make room (by tier), PUTs refused (by reason: pin_budget = "
            "pinned sessions fill the budget, too_large, disk_full; alert "
            "CtxcacheSidecarRefusing), pinned sessions that lost blocks, disk blocks that "
            "failed verification (dropped, recomputed).",
            "ops",
            (total("ctxcache_sidecar_evictions_total", by="tier"), "evicted {{tier}}"),
            (total("ctxcache_sidecar_refused_blocks_total", by="reason"), "refused {{reason}}"),
            (total("ctxcache_sidecar_pinned_dropped_sessions_total"), "pinned sessions dropped"),
            (total("ctxcache_sidecar_corrupt_blocks_total"), "corrupt"),
        ),
        row("Engine: vLLM with the ctxcache connector (or the built-in worker)"),
        timeseries(
            "Requests running and waiting",
            "vLLM's scheduler: requests running and waiting (queue), the waiting ones by "
            "reason (capacity: no room in the batch or the KV cache; deferred: e.g. a KV "
            "load in flight); the built-in worker's equivalents.",
            "short",
            (f"sum({sel('vllm:num_requests_running')})", "vLLM running"),
            (f"sum({sel('vllm:num_requests_waiting')})", "vLLM waiting"),
            (
                f"sum by (reason) ({sel('vllm:num_requests_waiting_by_reason')})",
                "vLLM waiting: {{reason}}",
            ),
            (f"sum({sel('ctxcache_worker_running')})", "worker running"),
            (f"sum({sel('ctxcache_worker_queue_waiting')})", "worker waiting"),
            w=6,
        ),
        timeseries(
            "KV cache usage and prefix hits",
            "vLLM's own KV cache use (fraction of blocks), and its prefix-cache hit rate "
            "(the in-engine tier).",
            "percentunit",
            (f"max({sel('vllm:kv_cache_usage_perc')})", "KV usage"),
            (
                share(
                    total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")
                ),
                "prefix-cache hit rate",
            ),
            w=6,
        ),
        timeseries(
            "Tokens per second",
            "Tokens generated per second (vLLM; the built-in worker), and vLLM's prompt "
            "tokens per second (prefilled or found cached).",
            "short",
            (total("vllm:generation_tokens_total"), "vLLM generated"),
            (total("ctxcache_worker_generated_tokens_total"), "worker generated"),
            (total("vllm:prompt_tokens_total"), "vLLM prompt"),
            w=6,
        ),
        timeseries(
            "vLLM preemptions",
            "Requests preempted per second: vLLM ran out of KV blocks and took a running "
            "request's back (recomputed later). Steady preemptions: the KV cache is too small "
            "for the load (see KV cache usage).",
            "ops",
            (total("vllm:num_preemptions_total"), "preemptions"),
            w=6,
        ),
        timeseries(
            "Engine TTFT",
            "The engine's own time to first token, p50/p95 (compare with the gateway's: the "
            "difference is the gateway and the store).",
            "s",
            *percentiles("vllm:time_to_first_token_seconds_bucket", "", "vLLM", (0.5, 0.95)),
            *percentiles("ctxcache_worker_ttft_seconds_bucket", "", "worker", (0.5, 0.95)),
            w=6,
        ),
        timeseries(
            "vLLM inter-token latency",
            "Time between two tokens of one answer (decode), p50/p95/p99: what a reader of a "
            "stream feels after the first token.",
            "s",
            *percentiles("vllm:inter_token_latency_seconds_bucket", "", "", (0.5, 0.95, 0.99)),
            w=6,
        ),
        timeseries(
            "vLLM queue time",
            "p50/p95/p99 of the time requests waited in vLLM's queue before being scheduled.",
            "s",
            *percentiles("vllm:request_queue_time_seconds_bucket", "", "", (0.5, 0.95, 0.99)),
            w=6,
        ),
        timeseries(
            "vLLM end-to-end latency",
            "p50/p95/p99 of a request's whole time in vLLM, arrival to last token (the "
            "gateway's End-to-end adds the gateway and the store).",
            "s",
            *percentiles("vllm:e2e_request_latency_seconds_bucket", "", "", (0.5, 0.95, 0.99)),
            w=6,
        ),
        row("KV load path: the ctxcache connector"),
        timeseries(
            "Tokens planned, loaded and stored",
            "Tokens per second of KV the scheduler planned to load from the sidecar, that "
            "were loaded into vLLM's cache (planned but not loaded: recomputed), and stored "
            "into the sidecar.",
            "short",
            (total("vllm:ctxcache_load_tokens_planned_total"), "planned"),
            (total("vllm:ctxcache_loaded_tokens_total"), "loaded"),
            (total("vllm:ctxcache_stored_tokens_total"), "stored"),
        ),
        timeseries(
            "Loads failed, stores dropped, sidecar errors",
            "Per second: loads that failed (a miss, an error or a block this engine cannot "
            "read; recomputed), shared-memory loads whose lease ended first (recomputed), "
            "finished requests whose KV was not stored (sidecar down, queue full), and "
            "sidecar calls that failed: the connector's and the built-in worker's, by "
            "operation (the turn still answers, slower).",
            "ops",
            (total("vllm:ctxcache_load_failures_total"), "loads failed"),
            (total("vllm:ctxcache_load_races_total"), "lease ended first"),
            (total("vllm:ctxcache_store_drops_total"), "stores dropped"),
            (total("vllm:ctxcache_sidecar_errors_total"), "connector sidecar errors"),
            (total("ctxcache_worker_sidecar_errors_total", by="op"), "worker {{op}}"),
        ),
        timeseries(
            "KV bytes per load",
            "Bytes of KV one load brought into vLLM's cache (shared memory and lm:// "
            "together), averaged over the loads of the window.",
            "bytes",
            (share(LOAD_BYTES, LOADS), "bytes per load"),
        ),
        timeseries(
            "Seconds per load",
            "Time one load took, averaged over the window: lease or GET to KV written "
            "(both paths); with async_loads, a load's whole time beside the engine's steps.",
            "s",
            (share(LOAD_SECONDS, LOADS), "per load"),
            (
                share(
                    f"sum({rate('vllm:ctxcache_async_load_ms_total')}) / 1000",
                    total("vllm:ctxcache_async_loads_total"),
                ),
                "per async load",
            ),
        ),
        timeseries(
            "Load bandwidth by path",
            "Bytes per second while loading, per data path: shm (the local sidecar's shared "
            "memory) and tcp (lm://). Compare with a plain copy of the same bytes on the "
            "machine (docs/deploy.md, Shared-memory KV path).",
            "Bps",
            (_bandwidth("shm"), "shm"),
            (_bandwidth("tcp"), "tcp"),
        ),
        timeseries(
            "Engine time spent by the connector",
            "Seconds of engine time per second the connector cost: waiting for loads, "
            "copying finished KV out, sidecar lookups in the scheduler.",
            "percentunit",
            (f"sum({rate('vllm:ctxcache_load_ms_total')}) / 1000", "loads"),
            (f"sum({rate('vllm:ctxcache_store_copy_ms_total')}) / 1000", "store copies"),
            (f"sum({rate('vllm:ctxcache_lookup_us_total')}) / 1e6", "lookups"),
        ),
        row("Session store: the manager and Redis"),
        stat(
            "Session store up",
            "1: the manager and its Redis answered the gateway's last scrape. Alert "
            "CtxcacheStoreUnavailable.",
            (f"min({sel('ctxcache_gateway_store_up')})", "store up"),
        ),
        stat(
            "Healthy workers",
            "Workers each gateway finds healthy (the lowest over gateways). Alert "
            "CtxcacheNoHealthyWorker.",
            (
                f"min(sum by (instance) ({sel('ctxcache_gateway_worker_healthy')}))",
                "healthy",
            ),
        ),
        timeseries(
            "Requests in flight per worker",
            "What each gateway has in flight on each worker (routing balances on this).",
            "short",
            (f"sum by (worker) ({sel('ctxcache_gateway_worker_inflight')})", "{{worker}}"),
            w=12,
            h=6,
        ),
        timeseries(
            "Manager requests by route and status",
            "Requests per second the manager answered (the gateway's session, turn, lock "
            "and rate-limit calls), by route template and status. Empty under `ctxcache "
            "serve`, whose gateway runs the manager in its own process.",
            "reqps",
            (total("ctxcache_manager_requests_total", by="route, status"), "{{route}} {{status}}"),
            w=6,
        ),
        timeseries(
            "Manager latency p95 by route",
            "p95 of the manager's answers by route template: mostly Redis round trips (and "
            "WAIT for replicas, when configured).",
            "s",
            (quantile(0.95, "ctxcache_manager_request_seconds_bucket", "route"), "{{route}}"),
            w=6,
        ),
        timeseries(
            "Redis memory",
            "Redis' memory (redis_exporter): used, resident, and maxmemory when one is set. "
            "The store runs with maxmemory-policy noeviction: at maxmemory writes fail "
            "(503 store_unavailable), sessions are never evicted.",
            "bytes",
            (f"max by (instance) ({sel('redis_memory_used_bytes')})", "used {{instance}}"),
            (f"max by (instance) ({sel('redis_memory_used_rss_bytes')})", "rss {{instance}}"),
            (f"max by (instance) ({sel('redis_memory_max_bytes')}) > 0", "max {{instance}}"),
            w=6,
        ),
        timeseries(
            "Redis commands and clients",
            "Commands per second, connected clients, connections refused (maxclients) and "
            "keys evicted per second (redis_exporter).",
            "short",
            (total("redis_commands_processed_total"), "commands/s"),
            (f"sum({sel('redis_connected_clients')})", "clients"),
            (total("redis_rejected_connections_total"), "rejected connections/s"),
            (total("redis_evicted_keys_total"), "evicted keys/s"),
            w=6,
        ),
        row("Processes: every service"),
        timeseries(
            "Resident memory",
            "Each service process' resident set size (vLLM: its API server; its engine "
            "core, which holds the model and the KV cache, is another process). Redis' own: "
            "the Redis memory panel.",
            "bytes",
            (
                f"sum by (job, instance) ({sel('process_resident_memory_bytes')})",
                "{{job}} {{instance}}",
            ),
        ),
        timeseries(
            "CPU",
            "CPU seconds per second (cores busy) of each service process.",
            "short",
            (total("process_cpu_seconds_total", by="job, instance"), "{{job}} {{instance}}"),
        ),
        timeseries(
            "Open file descriptors",
            "Open fds of each service process, as a share of its limit (sockets count: a "
            "leak of connections shows here first).",
            "percentunit",
            (
                f"sum by (job, instance) ({sel('process_open_fds')})"
                f" / sum by (job, instance) ({sel('process_max_fds')})",
                "{{job}} {{instance}}",
            ),
        ),
    ]


def variables() -> list[Any]:
    def query(
        name: str, label: str, definition: str, all_value: str, regex: str = ""
    ) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": definition,
            "query": {"query": definition, "refId": f"{name}-variable"},
            "regex": regex,
            "refresh": 2,  # on time range change
            "sort": 1,
            "multi": True,
            "includeAll": True,
            "allValue": all_value,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "hide": 0,
        }

    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
        },
        query("namespace", "Namespace", "label_values(up, namespace)", ALL_NAMESPACES),
        query(
            "job",
            "Job",
            'label_values(up{namespace=~"$namespace"}, job)',
            ALL_JOBS,
            regex="/ctxcache/",
        ),
        query(
            "model",
            "Model (vLLM)",
            'label_values(vllm:num_requests_running{job=~"$job", namespace=~"$namespace"}, '
            "model_name)",
            ALL_MODELS,
        ),
    ]


def build() -> dict[str, Any]:
    laid: list[Any] = []
    x = y = height = 0
    for i, panel in enumerate(panels(), start=1):
        w, h = panel.pop("_w"), panel.pop("_h")
        if x + w > 24 or panel["type"] == "row":
            x, y, height = 0, y + height, 0
        panel = {"type": panel.pop("type"), "title": panel.pop("title"), **panel}
        panel["id"] = i
        panel["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
        if panel["type"] != "row":
            panel["datasource"] = DATASOURCE
            targets = panel["targets"]
            assert len(targets) <= 8, panel["title"]
            panel["targets"] = [
                {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}
                for (expr, legend), ref in zip(targets, "ABCDEFGH", strict=False)
            ]
        laid.append(panel)
        x, height = x + w, max(height, h)
    return {
        "title": "ctxcache",
        "uid": "ctxcache-overview",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "tags": ["ctxcache"],
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "",
        "description": "ctxcache: gateway, session store, KV sidecar, and the engine (vLLM + "
        "the ctxcache connector, or the built-in worker). Pick one deployment with Namespace "
        "and Job (series of several never add up), vLLM's model with Model. "
        "docs/operations.md explains each panel.",
        "templating": {"list": variables()},
        "annotations": {"list": []},
        "panels": laid,
    }


def render() -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            sys.stderr.write(f"{OUT} is stale: run {Path(__file__).name}\n")
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
