"""The KV sidecar's row: memory and disk use, hit rate by tier, evictions."""

from __future__ import annotations

from typing import Any

from dashboard_panels.panel import row, timeseries
from dashboard_panels.promql import rate, sel, share, total

HITS, MISSES = "ctxcache_sidecar_hits_total", "ctxcache_sidecar_misses_total"
SIDECAR_READS = f"(sum({rate(HITS)}) + sum({rate(MISSES)}))"


def panels() -> list[Any]:
    return [
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
    ]
