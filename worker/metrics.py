"""Prometheus metrics of one worker, in a registry of its own (no process globals)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ctxcache.metrics import process_collectors

if TYPE_CHECKING:
    from worker.engine.request import Request
    from worker.kv.manager import CachedPrefix

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        process_collectors(r)  # RSS, CPU, open fds
        self.prompt_tokens = Counter("ctxcache_worker_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "ctxcache_worker_cached_tokens",
            "prompt tokens whose KV was reused, by tier",
            ["tier"],
            registry=r,
        )
        self.generated_tokens = Counter(
            "ctxcache_worker_generated_tokens", "generated tokens", registry=r
        )
        self.ttft = Histogram(
            "ctxcache_worker_ttft_seconds", "arrival to first token", buckets=_LATENCY, registry=r
        )
        self.batch_size = Histogram(
            "ctxcache_worker_decode_batch_size",
            "sequences per decode step",
            buckets=(1, 2, 4, 8, 16, 32),
            registry=r,
        )
        self.sidecar_errors = Counter(
            "ctxcache_worker_sidecar_errors",
            "sidecar failures and rejected blocks",
            ["op"],
            registry=r,
        )

    def gauge(self, name: str, help_text: str, fn: Callable[[], float]) -> None:
        Gauge(name, help_text, registry=self.registry).set_function(fn)

    def prefilled(self, request: Request, prefix: CachedPrefix) -> None:
        self.prompt_tokens.inc(len(request.prompt_ids))
        self.cached_tokens.labels("l1").inc(prefix.l1_tokens)
        self.cached_tokens.labels("sidecar").inc(prefix.sidecar_tokens)
        self.ttft.observe(time.monotonic() - request.arrival)
        if request.params.max_tokens:
            self.generated_tokens.inc(request.params.n)  # the first token of each choice

    def decoded(self, batch: int) -> None:
        self.batch_size.observe(batch)
        self.generated_tokens.inc(batch)

    def sidecar_error(self, op: str) -> None:
        self.sidecar_errors.labels(op).inc()
