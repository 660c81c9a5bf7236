"""The summary, Markdown table and plot of `ctxcache bench multiturn`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.lib.util import markdown_table
from benchmarks.multiturn.multiturn_stacks import STATELESS

VS_SESSION = f"{STATELESS}_vs_session"  # its TTFT p50 over the session's, per turn


def summary(rows: list[dict[str, Any]], names: list[str], replay: Any) -> dict[str, Any]:
    ref = replay.reference
    last = rows[-1]
    out: dict[str, Any] = {
        "reference": ref,
        "identical_outputs_every_turn": all(r["identical_outputs"] for r in rows),
        "differences": replay.differences(),
    }
    for mode in names:
        if mode == "floor":
            continue
        sizes = [r[mode]["request_bytes"] for r in rows]
        out[f"{mode}_bytes_last_over_first"] = sizes[-1] / sizes[0]
        if mode != ref:
            out[f"{mode}_speedup_last_turn"] = last[mode]["speedup_vs_reference"]
    for floor in ("roomy", "floor"):
        key = f"session_vs_{floor}"
        if key in last:
            later = [r[key] for r in rows if r["turn"] >= 2] or [rows[0][key]]
            out[f"{key}_max_from_turn_2"] = max(later)
    if VS_SESSION in last:
        out[f"{VS_SESSION}_last_turn"] = last[VS_SESSION]
    return out


def table(rows: list[dict[str, Any]], names: list[str], reference: str) -> str:
    headers = ["turn", "prompt tokens"]
    for mode in names:
        headers += [f"{mode} TTFT p50 / p90 ms", f"{mode} cached"]
        if mode != "floor":
            headers += [f"{mode} total p50 ms", f"{mode} bytes"]
    for mode in names:
        if mode != reference:
            headers += [f"{reference} / {mode}"]
    for floor in ("roomy", "floor"):
        if rows and f"session_vs_{floor}" in rows[0]:
            headers += [f"session / {floor}"]
    if rows and VS_SESSION in rows[0]:
        headers += [f"{STATELESS} / session"]
    headers += [f"same answer as {reference}"]
    out = []
    for r in rows:
        line: list[object] = [r["turn"], round(r[reference]["prompt_tokens"])]
        for mode in names:
            m = r[mode]
            line += [
                f"{m['ttft_p50_ms']:,.0f} / {m['ttft_p90_ms']:,.0f}",
                round(m["cached_tokens"]),
            ]
            if mode != "floor":
                line += [round(m["total_p50_ms"]), round(m["request_bytes"])]
        for mode in names:
            if mode != reference:
                line += [f"{r[mode]['speedup_vs_reference']:.2f}×"]
        for floor in ("roomy", "floor"):
            if f"session_vs_{floor}" in r:
                line += [f"{r[f'session_vs_{floor}']:.2f}×"]
        if VS_SESSION in r:
            line += [f"{r[VS_SESSION]:.2f}×"]
        same = [
            f"{m} {r[m]['identical']}"
            for m in names
            if m not in (reference, "floor") and "identical" in r[m]
        ]
        line += [", ".join(same) if same else "-"]
        out.append(line)
    return markdown_table(headers, out)


def plot(path: Path, rows: list[dict[str, Any]], names: list[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in names:
        left.plot(turns, [r[mode]["ttft_p50_ms"] for r in rows], marker="o", label=mode)
    left.set(xlabel="turn", ylabel="TTFT p50 (ms)", title=f"time to first token ({title})")
    for mode in [n for n in names if n != "floor"]:
        right.plot(turns, [r[mode]["request_bytes"] / 1024 for r in rows], marker="o", label=mode)
    right.set(xlabel="turn", ylabel="KiB per request", title="request bytes sent")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
