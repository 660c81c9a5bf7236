"""The gateway bench's rows: medians over rounds, and each case against direct, round by round."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Sample:
    """One case at one concurrency in one round."""

    requests_per_s: float
    p50_ms: float
    p99_ms: float
    ttft_ms: float | None  # p50 time to the first chunk (a stream, measured by our generator)
    errors: int
    generator: str


def rows(
    samples: dict[tuple[str, int], list[Sample]], direct_of: dict[str, str]
) -> list[dict[str, Any]]:
    """One row per (case, concurrency): the median round, and the median over rounds of its
    ratio to the direct case of the same round (`direct_of`: case -> its direct case)."""
    out = []
    for (case, conc), runs in samples.items():
        direct = samples.get((direct_of.get(case, ""), conc))
        row: dict[str, Any] = {
            "case": case,
            "concurrency": conc,
            "generator": runs[0].generator,
            "rounds": len(runs),
            "requests_per_s": _median(r.requests_per_s for r in runs),
            "p50_ms": _median(r.p50_ms for r in runs),
            "p99_ms": _median(r.p99_ms for r in runs),
            "ttft_ms": _median(r.ttft_ms for r in runs) if runs[0].ttft_ms is not None else None,
            "errors": sum(r.errors for r in runs),
        }
        for key in ("requests_per_s", "p50_ms", "p99_ms", "ttft_ms"):
            row[f"{key}_vs_direct"] = _ratio(runs, direct, key)
        row["p50_overhead_ms"] = (
            row["p50_ms"] - _median(r.p50_ms for r in direct)
            if direct and runs is not direct
            else 0.0
        )
        out.append(row)
    return out


def _median(values: Any) -> float:
    return float(statistics.median(values))


def _ratio(runs: list[Sample], direct: list[Sample] | None, key: str) -> float | None:
    """Median over rounds of this case's value ÷ the direct case's in the same round."""
    if not direct or runs is direct or getattr(runs[0], key) is None:
        return None
    pairs = [(getattr(r, key), getattr(d, key)) for r, d in zip(runs, direct, strict=False)]
    return _median(a / b for a, b in pairs if b)


COLUMNS = (
    ("case", "case"),
    ("concurrency", "concurrency"),
    ("generator", "generator"),
    ("requests_per_s", "req/s"),
    ("p50_ms", "p50 ms"),
    ("p99_ms", "p99 ms"),
    ("ttft_ms", "TTFT p50 ms"),
    ("requests_per_s_vs_direct", "req/s ÷ direct"),
    ("p50_ms_vs_direct", "p50 ÷ direct"),
    ("p99_ms_vs_direct", "p99 ÷ direct"),
    ("ttft_ms_vs_direct", "TTFT ÷ direct"),
    ("p50_overhead_ms", "p50 overhead ms"),
    ("errors", "errors"),
)


def table(data: list[dict[str, Any]]) -> str:
    from benchmarks.lib.util import markdown_table

    body = [["–" if row[key] is None else row[key] for key, _ in COLUMNS] for row in data]
    return markdown_table([title for _, title in COLUMNS], body)


def plot(path: Path, data: list[dict[str, Any]]) -> None:
    """The gateway ÷ direct on the same request, req/s, p99 and (where measured) TTFT
    (1 = as fast as direct). Session turns are left out: they do more than the direct call
    they are compared with."""
    from benchmarks.lib.util import bar_plot

    compared = [
        d
        for d in data
        if d["requests_per_s_vs_direct"] is not None and "session turn" not in d["case"]
    ]
    labels = [
        f"{d['case'].replace(': gateway, ', ', ').replace(', gateway', '')} @{d['concurrency']}"
        for d in compared
    ]
    series = {
        "req/s ÷ direct": [d["requests_per_s_vs_direct"] for d in compared],
        "p99 ÷ direct": [d["p99_ms_vs_direct"] for d in compared],
    }
    if any(d["ttft_ms_vs_direct"] is not None for d in compared):
        series["TTFT ÷ direct"] = [
            math.nan if d["ttft_ms_vs_direct"] is None else d["ttft_ms_vs_direct"] for d in compared
        ]  # (no bar where it was not measured)
    bar_plot(path, "gateway ÷ direct, same request and round", labels, series, "ratio")
