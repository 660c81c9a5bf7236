"""The connector's counters as vLLM connector stats and Prometheus counters on vLLM's
`/metrics` (`vllm:ctxcache_<name>_total`, labelled like vLLM's own per-engine metrics)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from vllm_connector.stats import COUNTERS


class CtxcacheStats(KVConnectorStats):
    """`data` is `{counter name: count}`; aggregating sums the counts."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CtxcachePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:ctxcache_{name}_total", documentation=doc, labelnames=labelnames
            )
            for name, doc in COUNTERS.items()
        }
        # every series exists from the start, at 0: a dashboard's `rate()` of a counter that
        # never moved (no store dropped yet) reads 0, not "no data"
        for counter in self._counters.values():
            for labels in per_engine_labelvalues.values():
                counter.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is not None and value:
                counter.labels(*labels).inc(value)
