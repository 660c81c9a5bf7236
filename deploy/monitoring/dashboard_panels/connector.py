"""The KV load path's row: the ctxcache connector in vLLM — tokens loaded, failures,
bytes and seconds per load, bandwidth, engine time.
"""

from __future__ import annotations

from typing import Any

from dashboard_panels.panel import row, timeseries
from dashboard_panels.promql import rate, share, total

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
    ]
