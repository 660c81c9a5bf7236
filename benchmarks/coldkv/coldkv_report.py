"""The cold-KV benchmark's JSON, Markdown table and plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GB = 1e9
LABELS = {
    "plain-memory": "plain, memory",
    "fp8-memory": "fp8, memory",
    "plain-disk": "plain, disk",
    "fp8-disk": "fp8, disk",
    "fp8-chunk": "fp8, per-chunk scales (not a sidecar)",
    "bf16-rounded": "reference: the fp32 KV rounded to bf16 (not a sidecar)",
}


def markdown(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [
        f"{meta['conversations']} conversations of {meta['context']} history tokens + "
        f"{meta['turn']} new ones, {meta['answer']} greedy answer tokens compared; chunks of "
        f"{meta['chunk_size']} tokens; load: median of {meta['reps']} per conversation, then the "
        "mean. Divergence: against the plain sidecar's KV (identical to a recompute: "
        + ", ".join(f"{r['dtype']} {r['plain_equals_recompute']}" for r in results)
        + "); |Δ logprob| and KL over the whole vocabulary, teacher-forced on the plain "
        "answer's tokens; max: the largest over every step of every conversation. How sure "
        "the model is of its greedy tokens (logprob of the top-1 less the top-2's, exact KV): "
        + ", ".join(
            f"{r['dtype']} median {r['top1_margin_median']:.3f} nats, "
            f"{r['top1_margin_below_0_5'] * 100:.0f}% of steps under 0.5"
            for r in results
        )
        + ".",
        "",
        "| KV dtype | sidecar | bytes / session | sessions / GB | load | KV rel. error | "
        "greedy answers equal | tokens until first difference | max \\|Δ logprob\\| | "
        "mean \\|Δ logprob\\| | KL mean | KL max | top-1 agree |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cases = r["cases"]
        copy_ms = cases["plain-memory"]["copy_s"] * 1000
        for case, c in cases.items():
            size = c.get("bytes")
            per_gb = f"{GB / size:,.1f}" if size else "—"
            load = f"{c['load_s'] * 1000:.1f} ms" if "load_s" in c else "—"
            lines.append(
                f"| {r['dtype']} | {LABELS[case]} | {f'{size / 1e6:.2f} MB' if size else '—'} | "
                f"{per_gb} | {load} | {c['kv_rel_err']:.4f} | "
                f"{c['greedy_exact'] * 100:.0f}% | {c['greedy_prefix']:.1f} / {meta['answer']} | "
                f"{c['max_abs_dlogprob']:.4f} | {c['mean_abs_dlogprob']:.5f} | "
                f"{c['kl_mean']:.2e} | {c['kl_max']:.2e} | {c['top1_agree'] * 100:.1f}% |"
            )
        lines.append(
            f"| {r['dtype']} | a plain copy of the same KV (torch `clone`) | | | "
            f"{copy_ms:.1f} ms | | | | | | | | |"
        )
    return "\n".join(lines) + "\n"


def plot(path: Path, results: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = ["plain-memory", "fp8-memory", "plain-disk", "fp8-disk"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    width = 0.8 / len(results)
    for k, r in enumerate(results):
        c = r["cases"]
        xs = [i + k * width for i in range(len(cases))]
        axes[0].bar(xs, [GB / c[x]["bytes"] for x in cases], width, label=r["dtype"])
        axes[1].bar(xs, [c[x]["load_s"] * 1000 for x in cases], width, label=r["dtype"])
        kl_cases = ["fp8-memory", "fp8-chunk"]
        axes[2].bar(
            [i + k * width for i in range(len(kl_cases))],
            [c[x]["kl_mean"] for x in kl_cases],
            width,
            label=r["dtype"],
        )
    for ax, title, labels in (
        (axes[0], "sessions held per GB (higher is better)", cases),
        (axes[1], "load of one session, ms (GET + to KV tensor)", cases),
        (axes[2], "mean KL(plain ‖ fp8) per answer token", ["per-token scales", "per-chunk"]),
    ):
        ax.set_title(title, fontsize=10)
        n = len(labels)
        ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(n)])
        ax.set_xticklabels(labels, rotation=15, ha="right")
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    out: Path, meta: dict[str, Any], results: list[dict[str, Any]], plot_file: Path
) -> list[Path]:
    from benchmarks.lib.util import write_outputs

    paths = write_outputs(
        out, "cold-kv", {"meta": meta, "results": results}, markdown(meta, results)
    )
    plot(plot_file, results)
    return [*paths, plot_file]
