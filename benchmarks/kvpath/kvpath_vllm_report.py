"""The rows, table and plot of `ctxcache bench kvpath --engine vllm` (kvpath_vllm.py)."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.kvpath.kvpath_vllm import BLOCK, COUNTERS, TARGET, TIMINGS, Turn


def row_of(dtype: str, path: str, context: int, turns: list[Turn], warmup: int) -> dict[str, Any]:
    counted = [t for t in turns if t.round >= warmup]
    hot = {t.round: t for t in counted if t.kind == "hot"}
    cold = {t.round: t for t in counted if t.kind == "cold"}
    ratios = [cold[r].ttft_ms / hot[r].ttft_ms for r in sorted(hot)]
    answers = [*hot.values(), *cold.values()]

    def total(name: str, kind: str | None = None) -> float:
        return sum(t.engine.get(name, 0.0) for t in counted if kind in (None, t.kind))

    def p50(kind: dict[int, Turn], name: str) -> float:
        return statistics.median(t.engine.get(name, 0.0) for t in kind.values())

    return {
        "dtype": dtype,
        "path": path,
        "context_tokens": context,
        "rounds": len(hot),
        "hot_ttft_p50_ms": statistics.median(t.ttft_ms for t in hot.values()),
        "cold_ttft_p50_ms": statistics.median(t.ttft_ms for t in cold.values()),
        "cold_vs_hot": statistics.median(ratios),
        "cold_vs_hot_rounds": ratios,
        "within_target": statistics.median(ratios) <= TARGET,
        "answers": len(answers),
        "answers_matched": sum(bool(t.matched) for t in answers),
        "answers_matched_cached": sum(bool(t.matched_cached) for t in answers),
        "cold_equals_hot": sum(cold[r].text == hot[r].text for r in hot),
        "cold_cached_tokens_min": min(t.cached_tokens for t in cold.values()),
        "cold_cached_ok": all(t.cached_tokens >= context - BLOCK for t in cold.values()),
        "counters": {c: total(c) for c in COUNTERS},
        "cold_loaded_tokens_min": min(t.engine["loaded_tokens"] for t in cold.values()),
        "hot_loaded_tokens": total("loaded_tokens", "hot"),
        # where a turn's time went, medians: vLLM's own view and the connector's
        **{f"hot_{k}_p50": p50(hot, k) for k in TIMINGS},
        **{f"cold_{k}_p50": p50(cold, k) for k in TIMINGS},
        "cold_load_ms_p50": p50(cold, "load_ms"),
        f"cold_load_us_{path}_p50": p50(cold, f"load_us_{path}"),
        "cold_lookup_us_p50": p50(cold, "lookup_us"),
        "turns": [asdict(t) for t in turns],
    }


def summary_line(r: dict[str, Any]) -> str:
    return (
        f"{r['dtype']} {r['path']}: hot {r['hot_ttft_p50_ms']:.0f} ms, cold "
        f"{r['cold_ttft_p50_ms']:.0f} ms, cold/hot {r['cold_vs_hot']:.2f}, answers "
        f"{r['answers_matched']}/{r['answers']}"
    )


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    from benchmarks.lib.util import markdown_table

    head = [
        "dtype",
        "path",
        "context tokens",
        "hot TTFT p50 ms",
        "cold TTFT p50 ms",
        "cold ÷ hot",
        f"≤ {TARGET}×",
        "answers = full history",
        "= full history, prefix-cached",
        "cold = hot",
        "cold cached (min)",
        "KV loaded MB shm / tcp",
        "load failures / races",
        "cold: vLLM TTFT / prefill p50 ms",
        "cold: connector load p50 ms",
        "hot: vLLM TTFT / prefill p50 ms",
        "others' CPU %",
    ]
    body = [
        [
            r["dtype"],
            r["path"],
            r["context_tokens"],
            r["hot_ttft_p50_ms"],
            r["cold_ttft_p50_ms"],
            f"{r['cold_vs_hot']:.2f}",
            "yes" if r["within_target"] else "no",
            f"{r['answers_matched']} of {r['answers']}",
            f"{r['answers_matched_cached']} of {r['answers']}",
            f"{r['cold_equals_hot']} of {r['rounds']}",
            r["cold_cached_tokens_min"],
            " / ".join(f"{r['counters'][f'load_bytes_{p}'] / 1e6:.1f}" for p in ("shm", "tcp")),
            f"{r['counters']['load_failures']:.0f} / {r['counters']['load_races']:.0f}",
            f"{r['cold_engine_ttft_ms_p50']:.0f} / {r['cold_prefill_ms_p50']:.0f}",
            r["cold_load_ms_p50"],
            f"{r['hot_engine_ttft_ms_p50']:.0f} / {r['hot_prefill_ms_p50']:.0f}",
            "?" if r.get("others_cpu_percent") is None else r["others_cpu_percent"],
        ]
        for r in rows
    ]
    return (
        markdown_table(head, body)
        + f"\n\nTTFT through the gateway, streamed; {meta['rounds']} rounds after "
        f"{meta['warmup']} warm-up, cold ÷ hot paired per round (median). Answers: hot and "
        f"cold, greedy, {meta['max_tokens']} tokens, against the whole conversation sent "
        "without a session, computed from scratch (a fresh cache_salt) and, the control, "
        "again from vLLM's own prefix cache. vLLM TTFT / prefill: its "
        "`time_to_first_token` and `request_prefill_time` histograms per turn. Others' CPU: "
        "what every other process on the machine used meanwhile, in % of one CPU.\n"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    from benchmarks.lib.util import bar_plot

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    series: dict[str, list[float]] = {}
    for p in dict.fromkeys(r["path"] for r in rows):
        by = {r["dtype"]: r["cold_vs_hot"] for r in rows if r["path"] == p}
        series[p] = [by.get(d, 0.0) for d in dtypes]
    bar_plot(
        path,
        f"Cold session turn TTFT ÷ hot, real vLLM (target ≤ {TARGET})",
        dtypes,
        series,
        "cold ÷ hot TTFT (median, paired per round)",
    )
