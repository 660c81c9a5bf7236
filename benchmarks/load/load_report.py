"""The outputs of `ctxcache bench load`: load.json, load.md and load.png (see benchutil)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("ctxcache.bench.load")

PARAMS = (
    "backend",
    "redis",
    "sessions",
    "turns",
    "concurrency",
    "workers",
    "max_tokens",
    "race_every",
)


def report(
    args: argparse.Namespace,
    row: dict[str, Any],
    samples: list[dict[str, float]],
    by_turn: dict[int, list[float]],
) -> int:
    """Write the three files, print the table; 0 when every check passed."""
    from benchmarks.lib.util import markdown_table, plot_path, run_meta, write_outputs

    meta = run_meta("load", **{k: getattr(args, k) for k in PARAMS})

    def trio(d: dict[str, Any]) -> str:
        return " / ".join("-" if v is None else str(v) for v in d.values())

    statuses = ", ".join(f"{k}: {v}" for k, v in row["statuses"].items())
    table = markdown_table(
        [
            "backend",
            "Redis",
            "sessions × turns",
            "concurrency",
            "turns ok",
            "statuses (retried)",
            "turn p50 ms",
            "turn p99 ms",
            "turns/s",
            "Redis keys before / loaded / after",
            "sidecar bytes before / loaded / after",
            "checks",
        ],
        [
            [
                row["backend"],
                row["redis"],
                f"{row['sessions']} × {row['turns_per_session']}",
                row["concurrency"],
                f"{row['turns_ok']}/{row['turns_expected']}",
                f"{statuses} ({row['retried']})",
                row["p50_ms"],
                row["p99_ms"],
                row["turns_per_s"],
                trio(row["redis_keys"]),
                trio(row["sidecar_bytes"]),
                "pass" if row["ok"] else f"FAIL ({len(row['failures'])})",
            ]
        ],
    )
    if row["rss_mib"]:
        table += "\n\n" + markdown_table(
            ["process", "RSS start MiB", "RSS peak MiB", "RSS end MiB"],
            [[p, v["start"], v["peak"], v["end"]] for p, v in row["rss_mib"].items()],
        )
    write_outputs(args.out, "load", {"meta": meta, "results": [row]}, table)
    plot(plot_path(args, "load"), samples, list(row["rss_mib"]), by_turn, row["backend"])
    print(table)
    if not row["ok"]:
        log.error("%d check(s) failed; see %s", len(row["failures"]), args.out / "load.json")
    return 0 if row["ok"] else 1


def plot(
    path: Path,
    samples: list[dict[str, float]],
    procs: list[str],
    by_turn: dict[int, list[float]],
    backend: str,
) -> None:
    """Left: RSS per process and requests in flight over time. Right: latency by turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.lib.util import percentile

    fig, (ax, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    ts = [r["t"] for r in samples]
    for p in procs:
        ax.plot(ts, [r[p] for r in samples], label=f"{p} RSS")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS MiB")
    ax.set_title(f"load ({backend}): memory and requests in flight")
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    twin.plot(ts, [r["inflight"] for r in samples], color="grey", alpha=0.6, label="in flight")
    twin.set_ylabel("requests in flight")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [str(h.get_label()) for h in handles], loc="upper left", fontsize=8)
    turns = list(by_turn)
    for q in (50, 99):
        lat.plot(turns, [percentile(by_turn[k], q) for k in turns], marker="o", label=f"p{q}")
    lat.set_xlabel("turn of the session")
    lat.set_ylabel("latency ms")
    lat.set_title("turn latency by turn (incl. retries)")
    lat.set_xticks(turns)
    lat.grid(alpha=0.3)
    lat.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
