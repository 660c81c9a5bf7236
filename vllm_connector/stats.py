"""Counters the connector keeps, drained into vLLM's connector stats every step.

vLLM sends each step's `KVConnectorStats` from the workers (and the scheduler's own) to its
logger, which logs them and feeds `build_prom_metrics`' counters on `/metrics`
(`vllm:ctxcache_<name>_total`).
"""

from __future__ import annotations

import threading

COUNTERS: dict[str, str] = {
    "lookups": "session requests looked up in the sidecar",
    "lookup_us": "microseconds the scheduler spent looking requests up in the sidecar",
    "load_tokens_planned": "tokens the scheduler planned to load from the sidecar",
    "loads": "loads carried out (one per request with KV planned from the sidecar, failed too)",
    "loaded_tokens": "tokens whose KV was written into vLLM's cache from the sidecar",
    "load_ms": "milliseconds the engine waited for loads (GETs and writes into its cache)",
    "async_loads": "loads carried out beside the engine's steps (async_loads)",
    "async_load_ms": "milliseconds loads ran beside the engine's steps (async_loads)",
    "store_copy_ms": "milliseconds the engine spent copying finished requests' KV out",
    "load_failures": "planned loads that failed (a miss, an error or a wrong block): recomputed",
    "load_errors": "loads that raised (CUDA out of memory, a failed copy or registration): "
    "a miss, recomputed, never a failed step",
    "store_errors": "stores that raised (CUDA out of memory, a failed copy): dropped",
    "stored_blocks": "blocks handed to the background storer",
    "stored_tokens": "tokens of KV handed to the background storer",
    "store_drops": "finished requests whose KV was not stored (sidecar down, queue full)",
    "stores_left_to_rank0": "finished requests a tensor-parallel rank > 0 did not store: "
    "an MLA model's latent, which rank 0 stores for every rank",
    "sidecar_errors": "sidecar calls that failed or timed out",
    # a hybrid model's recurrent state (vllm_connector.state_worker), over lm://
    "state_load_bytes": "bytes of recurrent state loaded (one state block per hit)",
    "state_store_bytes": "bytes of recurrent state stored (one state block per finished request)",
    # per data path: shm (the local sidecar's shared region) or tcp (lm://)
    "load_bytes_shm": "bytes of KV loaded through the local sidecar's shared memory",
    "load_us_shm": "microseconds spent loading KV through shared memory (lease to release; "
    "a step's sync loads share one lease, counted once)",
    "load_bytes_tcp": "bytes of KV loaded over lm:// (TCP)",
    "load_us_tcp": "microseconds spent loading KV over lm:// (GETs and writes)",
    "store_bytes_shm": "bytes of KV stored through the local sidecar's shared memory",
    "store_us_shm": "microseconds spent storing KV through shared memory (alloc to commit)",
    "store_bytes_tcp": "bytes of KV handed to the lm:// storer",
    "store_us_tcp": "microseconds spent copying KV out for the lm:// storer",
    "load_races": "shared-memory loads whose lease ended before release: recomputed",
    "region_full": "stores that found the shared region full and went over lm://",
    "store_failures_shm": "shared-memory stores the sidecar did not take (lease ended, "
    "refused): sent over lm:// instead",
}


class Counters:
    """Thread-safe counts since the last `drain`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, name: str, amount: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        with self._lock:
            self._values[name] = self._values.get(name, 0) + amount

    def drain(self) -> dict[str, int]:
        with self._lock:
            out, self._values = self._values, {}
        return out
