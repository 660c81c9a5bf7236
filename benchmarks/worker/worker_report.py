"""The worker benchmark's JSON, Markdown table and plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LABELS = {
    "full": "full recompute",
    "sidecar": "sidecar hit (cold L1)",
    "l1": "L1 hit",
    "floor": "floor (new tokens only)",
}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    from benchmarks.lib.util import header

    lines = [
        header(meta),
        "",
        f"Median of {meta['reps']} turns; +{meta['new_tokens']} new tokens; chunk "
        f"{meta['chunk_size']}. Ratios: median over turns of each cached turn's TTFT / the "
        "floor measured right before and after it.",
        "",
        "| context | full recompute | sidecar hit (cold L1) | L1 hit | floor | "
        "sidecar / floor | L1 / floor | cached (sidecar / L1) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        floor = r["floor_s"]
        lines.append(
            f"| {r['context_tokens']} | {r['full_s'] * 1000:.0f} ms | "
            f"{r['sidecar_s'] * 1000:.0f} ms | {r['l1_s'] * 1000:.0f} ms | "
            f"{floor * 1000:.0f} ms | {r['sidecar_over_floor']:.2f}× | {r['l1_over_floor']:.2f}× | "
            f"{r['sidecar_cached_tokens']} / {r['l1_cached_tokens']} |"
        )
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.2
    xs = range(len(rows))
    for i, case in enumerate(LABELS):
        ax.bar(
            [x + (i - 1.5) * width for x in xs],
            [r[f"{case}_s"] * 1000 for r in rows],
            width,
            label=LABELS[case],
        )
    ax.set_xticks(list(xs), [str(r["context_tokens"]) for r in rows])
    ax.set_xlabel("context tokens (+ new turn)")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_yscale("log")
    ax.set_title("ctxcache CPU worker: TTFT with cached history vs recompute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(
    out: Path, meta: dict[str, Any], rows: list[dict[str, Any]], png: Path | None = None
) -> list[Path]:
    """worker.json (`{"meta", "results"}`), worker.md and the plot (default worker.png)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "worker.json", out / "worker.md", png or out / "worker.png"]
    paths[0].write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    paths[1].write_text(markdown(meta, rows))
    paths[2].parent.mkdir(parents=True, exist_ok=True)
    plot(paths[2], rows)
    return paths
