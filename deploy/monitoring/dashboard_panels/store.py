"""The session store's row: the manager and Redis, and the workers the gateway sees."""

from __future__ import annotations

from typing import Any

from dashboard_panels.panel import row, stat, timeseries
from dashboard_panels.promql import quantile, sel, total


def panels() -> list[Any]:
    return [
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
    ]
