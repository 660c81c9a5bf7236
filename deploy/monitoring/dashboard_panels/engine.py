"""The engine's row: vLLM (or the built-in worker) — scheduler, KV cache, tokens,
latencies.
"""

from __future__ import annotations

from typing import Any

from dashboard_panels.panel import percentiles, row, timeseries
from dashboard_panels.promql import sel, share, total


def panels() -> list[Any]:
    return [
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
    ]
