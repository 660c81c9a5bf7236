"""What every service's Prometheus registry shares: the process collectors, and a request
counter/timer by route template.

Each service keeps its metrics in a registry of its own (no process globals), so
prometheus_client's default process metrics are not in it; `process_collectors` adds them:
`process_resident_memory_bytes`, `process_cpu_seconds_total`, `process_open_fds` (and
`process_max_fds`, start time, virtual memory), `python_info` and `python_gc_*`. Where
several services share one process (tests), each registry reports the same process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

if TYPE_CHECKING:  # (starlette only for types: the sidecar imports this where it is absent)
    from starlette.types import ASGIApp, Message, Receive, Scope, Send


def process_collectors(registry: CollectorRegistry) -> None:
    """Register this process' RSS, CPU, open fds, Python version and GC in `registry`."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


Observe = Callable[[str, int, float], None]  # (route template, status, seconds)


class RouteMetricsMiddleware:
    """Reports every HTTP request's route template (never its raw path: ids stay out of
    the labels; "other" when no route matched, or a middleware answered before routing),
    status and duration to `observe`."""

    def __init__(self, app: ASGIApp, observe: Observe) -> None:
        self.app = app
        self.observe = observe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.observe(route, status, time.perf_counter() - t0)
