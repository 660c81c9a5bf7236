"""Bench output: JSON rows, a Markdown table and a PNG plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Row:
    target: str
    op: str  # "put" | "get"
    size: int
    clients: int
    ops: int  # over all rounds
    rounds: int
    gbps: float  # 1e9 payload bytes per second, median over the rounds
    p50_ms: float
    p99_ms: float
    round_gbps: tuple[float, ...] = ()  # each round's GB/s, in round order


OURS = "ctxcache"


def paired(ours: Row, ref: Row) -> tuple[float, int, int]:
    """Ours vs a reference, round by round (both ran in the same round, back to back, so
    a disturbance of the shared machine falls on both): the median ratio, and in how many
    of the rounds ours was faster."""
    ratios = sorted(a / b for a, b in zip(ours.round_gbps, ref.round_gbps, strict=True) if b)
    if not ratios:
        return float("nan"), 0, 0
    return ratios[len(ratios) // 2], sum(r > 1 for r in ratios), len(ratios)


def human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def markdown(rows: list[Row], targets: list[str]) -> str:
    by = {(r.target, r.op, r.size, r.clients): r for r in rows}
    refs = [t for t in targets if t != OURS] if OURS in targets else []
    head = ["op", "block", "clients"] + [f"{t} GB/s (p50 / p99 ms)" for t in targets]
    head += [f"{OURS} ÷ {t}, paired (rounds ahead)" for t in refs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cases = sorted({(r.op, r.size, r.clients) for r in rows}, key=lambda c: (c[0] != "get", *c[1:]))
    for op, size, clients in cases:
        cells = [op.upper(), human(size), str(clients)]
        best = max(
            (by[(t, op, size, clients)].gbps for t in targets if (t, op, size, clients) in by),
            default=0.0,
        )
        for t in targets:
            r = by.get((t, op, size, clients))
            if r is None:
                cells.append("n/a")
                continue
            gb = f"**{r.gbps:.2f}**" if r.gbps == best else f"{r.gbps:.2f}"
            cells.append(f"{gb} ({r.p50_ms:.2f} / {r.p99_ms:.2f})")
        for t in refs:
            ours, ref = by.get((OURS, op, size, clients)), by.get((t, op, size, clients))
            if ours is None or ref is None or not ours.round_gbps:
                cells.append("n/a")
                continue
            ratio, ahead, rounds = paired(ours, ref)
            cells.append(f"{ratio:.2f} ({ahead}/{rounds})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], targets: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, op in zip(axes, ("get", "put"), strict=True):
        cases = sorted({(r.size, r.clients) for r in rows if r.op == op})
        width = 0.8 / max(1, len(targets))
        for i, t in enumerate(targets):
            vals = [
                next(
                    (r.gbps for r in rows if (r.target, r.op, r.size, r.clients) == (t, op, s, c)),
                    0.0,
                )
                for s, c in cases
            ]
            ax.bar([x + i * width for x in range(len(cases))], vals, width, label=t)
        ax.set_xticks([x + width * (len(targets) - 1) / 2 for x in range(len(cases))])
        ax.set_xticklabels([f"{human(s)}\n{c} client{'s' if c > 1 else ''}" for s, c in cases])
        ax.set_title(f"{op.upper()} throughput (loopback)")
        ax.set_ylabel("GB/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(
    rows: list[Row], targets: list[str], out: Path, meta: dict[str, Any], png: Path | None = None
) -> list[Path]:
    """sidecar.json (`{"meta", "results"}`), sidecar.md and the plot (default sidecar.png)."""
    from benchmarks.lib.util import write_outputs

    paths = write_outputs(
        out,
        "sidecar",
        {"meta": meta, "results": [asdict(r) for r in rows]},
        markdown(rows, targets),
    )
    paths.append(png or out / "sidecar.png")
    paths[-1].parent.mkdir(parents=True, exist_ok=True)
    plot(rows, targets, paths[-1])
    return paths
