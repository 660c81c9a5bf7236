"""The stack's components as `ctxcache serve`'s supervisor sees them (its status file,
`ctxcache/supervisor.py`): which are up, which are (re)starting and since when, how often
each was restarted.

The gateway uses it three ways: `/ready` says which component is not up and for how long
("vllm is starting, 12 s so far; its last start took 58 s"); a 503 `backend_unavailable`
while the engine restarts carries a `retry-after` of the start time still expected, so an
openai SDK's retries span it; and `/metrics` has `ctxcache_component_up` and
`ctxcache_component_restarts_total`. Without a status file (the gateway run on its own,
compose, Kubernetes: their orchestrator restarts containers) all of this is empty.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# a component that is not up is expected within its last start time; one never started
# (or whose start time is unknown) within this many seconds
UNKNOWN_START_S = 5.0
MAX_RETRY_AFTER_S = 60.0  # the openai SDKs ignore a longer retry-after


@dataclass(frozen=True)
class Component:
    name: str
    state: str  # starting, up, restarting (waiting its backoff), down (given up)
    since: float  # unix time it entered `state`
    restarts: int
    start_s: float | None  # how long its last start took

    def eta_s(self, now: float) -> float | None:
        """Seconds until it is expected up; None when it is up or given up."""
        if self.state not in ("starting", "restarting"):
            return None
        return max(0.0, (self.start_s or UNKNOWN_START_S) - (now - self.since))

    def describe(self, now: float) -> str:
        took = f"; its last start took {self.start_s:.0f} s" if self.start_s else ""
        if self.state == "down":
            return f"{self.name} is down (it kept crashing: not restarted again)"
        return f"{self.name} is {self.state}, {now - self.since:.0f} s so far{took}"


class Components:
    """The status file, read at most every `ttl_s` (a scrape or a 503 reads it)."""

    def __init__(self, path: Path | None, ttl_s: float = 0.5) -> None:
        self.path, self.ttl_s = path, ttl_s
        self._read_at = -float("inf")
        self._cached: list[Component] = []

    def all(self) -> list[Component]:
        if self.path is None:
            return []
        if time.monotonic() - self._read_at >= self.ttl_s:
            self._cached = self._read(self.path)
            self._read_at = time.monotonic()
        return self._cached

    @staticmethod
    def _read(path: Path) -> list[Component]:
        try:
            doc = json.loads(path.read_text())
            return [
                Component(
                    name=name,
                    state=str(c["state"]),
                    since=float(c["since"]),
                    restarts=int(c["restarts"]),
                    start_s=None if c.get("start_s") is None else float(c["start_s"]),
                )
                for name, c in doc["components"].items()
            ]
        except FileNotFoundError:
            return []  # serve is stopping (it removes the file), or not started yet
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("unreadable components file %s: %s", path, exc)
            return []

    def not_up(self) -> list[Component]:
        return [c for c in self.all() if c.state != "up"]

    def retry_after_s(self) -> float:
        """When a request that found no worker is worth retrying: when the slowest
        component now (re)starting is expected up (at least 1 s, at most 60 s)."""
        now = time.time()
        etas = [eta for c in self.all() if (eta := c.eta_s(now)) is not None]
        return min(MAX_RETRY_AFTER_S, max([1.0, *etas]))

    def describe(self) -> str:
        """'; vllm is starting, 12 s so far; ...' for an error message, or ''."""
        now = time.time()
        return "".join(f"; {c.describe(now)}" for c in self.not_up())


class ComponentCollector(Collector):
    """`ctxcache_component_up{component}` and `ctxcache_component_restarts_total`."""

    def __init__(self, components: Components) -> None:
        self.components = components

    def collect(self) -> Iterator[Metric]:
        found = self.components.all()
        up = GaugeMetricFamily(
            "ctxcache_component_up",
            "1 when a component of ctxcache serve is up, 0 while it (re)starts or is down",
            labels=["component"],
        )
        restarts = CounterMetricFamily(
            "ctxcache_component_restarts",
            "times ctxcache serve restarted a component that died",
            labels=["component"],
        )
        for c in found:
            up.add_metric([c.name], 1.0 if c.state == "up" else 0.0)
            restarts.add_metric([c.name], float(c.restarts))
        yield up
        yield restarts
