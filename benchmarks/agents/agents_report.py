"""The rows, Markdown table and plot of `ctxcache bench agents`: medians over the rounds,
each way against `stateless` (vLLM at its best) step by step and over the whole loop."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.lib.util import markdown_table

BASE = "stateless"
KEYS = ("way", "step", "kind")  # a row's, not repeated in its rounds


def _median(values: list[float | int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def loop_totals(records: list[dict[str, Any]], way: str) -> dict[int, float]:
    """Each round's loop time of `way`, ms: its create (if any) and all its requests."""
    out: dict[int, float] = {}
    for r in records:
        if r["way"] == way:
            out[r["round"]] = out.get(r["round"], 0.0) + r["total_ms"]
    return out


def totals(records: list[dict[str, Any]], ways: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for way in ways:
        per_round = loop_totals(records, way)
        creates = [r["total_ms"] for r in records if r["way"] == way and r["kind"] == "create"]
        out[way] = {
            "loop_ms": _median(list(per_round.values())),
            "loop_ms_rounds": [per_round[k] for k in sorted(per_round)],
            "create_ms": _median(creates),
            "create_ms_rounds": creates,
        }
    for way in ways:
        if way != BASE and BASE in out:
            out[f"{way}_vs_{BASE}"] = _ratio(out[way]["loop_ms"], out[BASE]["loop_ms"])
    return out


def rows(records: list[dict[str, Any]], ways: list[str], requests: int) -> list[dict[str, Any]]:
    """One row per step (the last is the text answer): each way's medians over the rounds,
    and TTFT ratios against `stateless`."""
    out = []
    for step in range(1, requests + 1):
        row: dict[str, Any] = {"step": step, "kind": "answer" if step == requests else "call"}
        for way in ways:
            rs = [r for r in records if r["way"] == way and r["step"] == step]
            row[way] = {
                "ttft_ms": _median([r["ttft_ms"] for r in rs]),
                "engine_ttft_ms": _median([r.get("engine_ttft_ms") for r in rs]),
                "total_ms": _median([r["total_ms"] for r in rs]),
                "prompt_tokens": _median([r["prompt_tokens"] for r in rs]),
                "cached_tokens": _median([r["cached_tokens"] for r in rs]),
                "request_bytes": _median([r["request_bytes"] for r in rs]),
                "rounds": [{k: v for k, v in r.items() if k not in KEYS} for r in rs],
            }
        for way in ways:
            if way != BASE and BASE in ways:
                row[f"{way}_vs_{BASE}"] = _ratio(row[way]["ttft_ms"], row[BASE]["ttft_ms"])
                row[f"{way}_vs_{BASE}_engine"] = _ratio(
                    row[way]["engine_ttft_ms"], row[BASE]["engine_ttft_ms"]
                )
        out.append(row)
    return out


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}×"


def _tokens(m: dict[str, Any]) -> str:
    if m["cached_tokens"] is None or m["prompt_tokens"] is None:
        return "-"
    return f"{m['cached_tokens']:.0f} / {m['prompt_tokens']:.0f}"


def table(meta: dict[str, Any], rows: list[dict[str, Any]], ways: list[str]) -> str:
    """Per step: each way's TTFT (the client's / vLLM's own, medians, ms), cached / prompt
    tokens, the ratios; then the loop's total time (the session's create included); then
    the machine's CPU and dtype."""
    others = [w for w in ways if w != BASE and BASE in ways]
    headers = ["step"]
    headers += [f"{way} TTFT / engine ms" for way in ways]
    headers += [f"{way} cached / prompt" for way in ways]
    headers += [f"{w} ÷ {BASE} (TTFT / engine)" for w in others]
    lines: list[list[object]] = []
    for r in rows:
        line: list[object] = [f"{r['step']} ({r['kind']})"]
        line += [f"{_ms(r[w]['ttft_ms'])} / {_ms(r[w]['engine_ttft_ms'])}" for w in ways]
        line += [_tokens(r[w]) for w in ways]
        line += [f"{_x(r[f'{w}_vs_{BASE}'])} / {_x(r[f'{w}_vs_{BASE}_engine'])}" for w in others]
        lines.append(line)
    t = meta["totals"]
    line = ["loop total ms"]
    for way in ways:
        create = t[way]["create_ms"]
        line.append(_ms(t[way]["loop_ms"]) + (f" (create {_ms(create)})" if create else ""))
    line += [""] * len(ways)
    lines.append(line + [_x(t[f"{w}_vs_{BASE}"]) for w in others])
    cpu = meta.get("cpu") or {}
    notes = [
        f"{meta['steps']} tool calls of {meta['tool_tokens']}-token results and a text answer, "
        f"median of {meta['rounds']} rounds. TTFT: to the first streamed content or "
        "tool-call delta; engine: vLLM's own time to first token (its /metrics).",
        f"CPU: {cpu.get('model')} ({cpu.get('class', '?')}), "
        f"AMX {'yes' if cpu.get('amx') else 'no'}, avx512_bf16 "
        f"{'yes' if cpu.get('avx512_bf16') else 'no'}; vLLM ran in {meta.get('vllm_dtype')}, "
        f"tool parser {meta.get('tool_call_parser')}.",
    ]
    notes += [f"**{way} failed:** {error}" for way, error in (meta.get("errors") or {}).items()]
    return markdown_table(headers, lines) + "\n\n" + "\n".join(notes) + "\n"


def plot(path: Path, rows: list[dict[str, Any]], ways: list[str], title: str) -> None:
    """TTFT per step, one line per way (the median; the rounds' spread shaded): as the
    client sees it, and vLLM's own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    steps = [r["step"] for r in rows]
    for ax, key, what in (
        (axes[0], "ttft_ms", "client TTFT (first content or tool-call delta)"),
        (axes[1], "engine_ttft_ms", "vLLM's own TTFT (its /metrics)"),
    ):
        for way in ways:
            medians = [r[way][key] for r in rows]
            if None in medians:
                continue
            ax.plot(steps, medians, marker="o", label=way)
            spread = [[x.get(key) or 0.0 for x in r[way]["rounds"]] for r in rows]
            ax.fill_between(steps, [min(s) for s in spread], [max(s) for s in spread], alpha=0.15)
        ax.set(xlabel="step (the last: the text answer)", ylabel="ms", title=what)
        ax.set_xticks(steps)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"agent loop, TTFT per step ({title})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
