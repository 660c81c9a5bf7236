"""Prometheus metrics of one sidecar, in its own registry (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from ctxcache.metrics import process_collectors

PREFIX = "ctxcache_sidecar"


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        process_collectors(r)  # RSS, CPU, open fds
        self.requests = Counter(
            f"{PREFIX}_requests", "data-port requests by command", ["command"], registry=r
        )
        self.hits = Counter(f"{PREFIX}_hits", "GET hits by tier", ["tier"], registry=r)
        self.misses = Counter(f"{PREFIX}_misses", "GET misses", registry=r)
        self.bytes_in = Counter(f"{PREFIX}_put_bytes", "payload bytes received", registry=r)
        self.bytes_out = Counter(f"{PREFIX}_get_bytes", "payload bytes sent", registry=r)
        self.evictions = Counter(
            f"{PREFIX}_evictions", "blocks dropped to make room, by tier", ["tier"], registry=r
        )
        self.spills = Counter(f"{PREFIX}_spills", "blocks written to the disk tier", registry=r)
        self.write_behind_blocks = Counter(
            f"{PREFIX}_write_behind_blocks",
            "pinned memory blocks given a disk copy by write-behind (also counted in spills)",
            registry=r,
        )
        self.write_behind_bytes = Counter(
            f"{PREFIX}_write_behind_bytes", "payload bytes written by write-behind", registry=r
        )
        self.corrupt = Counter(
            f"{PREFIX}_corrupt_blocks", "disk blocks that failed verification", registry=r
        )
        self.refused = Counter(
            f"{PREFIX}_refused_blocks", "PUTs not stored, by reason", ["reason"], registry=r
        )
        self.pinned_dropped = Counter(
            f"{PREFIX}_pinned_dropped_blocks",
            "pinned blocks dropped to make room (pin policy lru), by the tier they left",
            ["tier"],
            registry=r,
        )
        self.pinned_dropped_sessions = Counter(
            f"{PREFIX}_pinned_dropped_sessions",
            "times a pinned session lost its blocks to make room (pin policy lru)",
            registry=r,
        )
        self.expired = Counter(
            f"{PREFIX}_expired_sessions", "sessions dropped at expiry", registry=r
        )
        self.connections = Gauge(f"{PREFIX}_connections", "open data connections", registry=r)
        # the local (shared-memory) data path
        self.region_full = Counter(
            f"{PREFIX}_region_full",
            "times no slot of the shared region could be had (the block stayed in the heap, "
            "or a local store fell back to TCP)",
            registry=r,
        )
        self.local_requests = Counter(
            f"{PREFIX}_local_requests", "local-socket requests by op", ["op"], registry=r
        )
        self.local_bytes = Counter(
            f"{PREFIX}_local_bytes",
            "payload bytes engines copied through the shared region, by direction (load: "
            "leased to an engine; store: committed by one)",
            ["direction"],
            registry=r,
        )
        self.leases_expired = Counter(
            f"{PREFIX}_leases_expired",
            "leases ended by their timeout or their holder's connection closing, not released",
            ["reason"],
            registry=r,
        )
        self.local_connections_evicted = Counter(
            f"{PREFIX}_local_connections_evicted",
            "idle local-socket connections closed to admit a new one past the cap",
            registry=r,
        )
        self.local_connections = Gauge(
            f"{PREFIX}_local_connections", "open local-socket connections", registry=r
        )
        self._gauges: dict[str, Gauge] = {}

    def render(self, stats: Callable[[], dict[str, Any]]) -> bytes:
        """Exposition text; the store's numeric stats become gauges at scrape time."""
        for name, value in stats().items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            gauge = self._gauges.get(name)
            if gauge is None:
                gauge = Gauge(f"{PREFIX}_{name}", f"store stat {name}", registry=self.registry)
                self._gauges[name] = gauge
            gauge.set(value)
        return generate_latest(self.registry)
