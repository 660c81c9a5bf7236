"""Shared pieces of the benchmark commands: timing, percentiles, output files, plots."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


@dataclass
class Result:
    name: str
    concurrency: int
    ops: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "ops_per_s": round(self.ops_per_s, 1)}


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


async def measure(
    name: str,
    op: Callable[[int], Awaitable[object]],
    *,
    ops: int,
    concurrency: int,
    progress: Callable[[int], object] | None = None,
) -> Result:
    """Run `op(i)` `ops` times over `concurrency` asyncio tasks; latency per call."""
    import asyncio

    latencies: list[float] = []
    counter = iter(range(ops))

    async def runner() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - t0)
            if progress is not None:
                progress(1)

    start = time.perf_counter()
    await asyncio.gather(*(runner() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return Result(
        name,
        concurrency,
        ops,
        elapsed,
        percentile(latencies, 50) * 1e3,
        percentile(latencies, 99) * 1e3,
    )


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def write_outputs(out_dir: Path, name: str, data: dict[str, Any], table: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=2))
    (out_dir / f"{name}.md").write_text(table + "\n")


def bar_plot(
    path: Path, title: str, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(series))
    for k, (label, values) in enumerate(series.items()):
        xs = [i + k * width for i in range(len(labels))]
        ax.bar(xs, values, width=width, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
