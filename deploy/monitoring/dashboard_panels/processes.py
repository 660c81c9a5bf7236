"""The processes' row: memory, CPU and file descriptors of every service."""

from __future__ import annotations

from typing import Any

from dashboard_panels.panel import row, timeseries
from dashboard_panels.promql import sel, total


def panels() -> list[Any]:
    return [
        row("Processes: every service"),
        timeseries(
            "Resident memory",
            "Each service process' resident set size (vLLM: its API server; its engine "
            "core, which holds the model and the KV cache, is another process). Redis' own: "
            "the Redis memory panel.",
            "bytes",
            (
                f"sum by (job, instance) ({sel('process_resident_memory_bytes')})",
                "{{job}} {{instance}}",
            ),
        ),
        timeseries(
            "CPU",
            "CPU seconds per second (cores busy) of each service process.",
            "short",
            (total("process_cpu_seconds_total", by="job, instance"), "{{job}} {{instance}}"),
        ),
        timeseries(
            "Open file descriptors",
            "Open fds of each service process, as a share of its limit (sockets count: a "
            "leak of connections shows here first).",
            "percentunit",
            (
                f"sum by (job, instance) ({sel('process_open_fds')})"
                f" / sum by (job, instance) ({sel('process_max_fds')})",
                "{{job}} {{instance}}",
            ),
        ),
    ]
