"""The rows, headline, answer check, table and plot of `ctxcache bench capacity`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.capacity.capacity_load import Point, Sent
from benchmarks.lib.util import markdown_table, percentile

# the mode whose answers the session's are compared with: the same engine configuration
REFERENCES = ("vllm-full-connector", "vllm-full", "roomy")
HELD_RATE = 0.9  # a rate is held when at least this share of it was achieved


def row(point: Point, warmup: int, slo_s: float) -> dict[str, Any]:
    """One mode at one rate: what was achieved, latencies, errors, and whether it held."""
    questions = [s for s in point.sent if s.round > 0 and s.index >= warmup]
    creates = [s for s in point.sent if s.create]
    ok = [s for s in questions if s.error is None]
    prefills = [s for s in creates if s.round == 0]  # (not questions: counted here)
    errors = sum(1 for s in questions if s.error) + sum(1 for s in prefills if s.error)
    sends = sorted(s.sent for s in questions)
    achieved = (len(sends) - 1) / (sends[-1] - sends[0]) if len(sends) > 1 else 0.0
    ttft = [s.ttft for s in ok]
    first = [s.ttft for s in ok if s.round == 1]
    later = [s.ttft for s in ok if s.round > 1]
    itl = [s.itl for s in ok if s.itl is not None]
    span = (max(s.sent + s.total for s in ok) - sends[0]) if ok else 0.0
    prompt = sum(s.prompt_tokens for s in ok)
    out = {
        "mode": point.mode,
        "qps": point.qps,
        "achieved_qps": achieved,
        "requests": len(questions),
        "errors": errors,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p95_ms": percentile(ttft, 95) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_mean_ms": sum(itl) / len(itl) * 1e3 if itl else float("nan"),
        "output_tokens_per_s": sum(s.completion_tokens for s in ok) / span if span else 0.0,
        "prompt_tokens_mean": prompt / len(ok) if ok else 0.0,
        "cached_ratio": sum(s.cached_tokens for s in ok) / prompt if prompt else 0.0,
        "creates": len(creates),
        "create_p50_ms": percentile([s.total for s in creates if not s.error], 50) * 1e3,
        "create_p95_ms": percentile([s.total for s in creates if not s.error], 95) * 1e3,
        # a user's first question (its whole context is new) and its later ones
        "first_ttft_p50_ms": percentile(first, 50) * 1e3,
        "first_ttft_p95_ms": percentile(first, 95) * 1e3,
        "later_ttft_p50_ms": percentile(later, 50) * 1e3,
        "later_ttft_p95_ms": percentile(later, 95) * 1e3,
        "seconds": point.seconds,
    }
    out["held"] = held(out, slo_s) and bool(ok)
    return out


def held(row: dict[str, Any], slo_s: float) -> bool:
    """Whether a rate's row holds `slo_s`: p95 TTFT within it, at least HELD_RATE of the rate
    done, no error. (The row's figures do not depend on the SLO: an earlier run's rows can
    be judged again at another, `--from`.)"""
    return bool(
        row["requests"]
        and row["errors"] == 0
        and row["ttft_p95_ms"] <= slo_s * 1e3
        and row["achieved_qps"] >= HELD_RATE * row["qps"]
    )


def capacity(rows: list[dict[str, Any]], modes: list[str]) -> dict[str, float | None]:
    """The highest offered rate each mode held (None: it held none of those it ran)."""
    out: dict[str, float | None] = {}
    for mode in modes:
        held = [r["qps"] for r in rows if r["mode"] == mode and r["held"]]
        out[mode] = max(held) if held else None
    return out


# per mode, each answer by (user, round), with the rate it was asked at
Answers = dict[str, dict[tuple[int, int], tuple[float, str]]]


def answers(points: list[Point]) -> Answers:
    out: Answers = {}
    for p in points:
        for s in p.sent:
            if s.round > 0 and s.error is None:
                out.setdefault(p.mode, {})[(s.user, s.round)] = (p.qps, s.answer)
    return out


def compare(by_mode: Answers, mode: str = "session", ref: str | None = None) -> dict[str, Any]:
    """`mode`'s answers against `ref`'s (default: the first of REFERENCES run), per (user,
    round). A user's conversation is a function of its number alone, and each rate of a run
    numbers its users from a start of its own (`USERS_PER_RATE`), so within one run only the
    rates both modes ran are compared, and across runs merged with `--with` the same number is
    the same conversation at whatever rate each run asked it. A conversation counts once:
    after its first different answer its history differs, so its later rounds are not
    compared (`after_divergence`)."""
    ref = ref or next((m for m in REFERENCES if m in by_mode), None)
    out: dict[str, Any] = {"reference": ref, "compared": 0, "mismatches": 0}
    out |= {"after_divergence": 0, "examples": [], "agreed_share_median": None}
    if ref not in by_mode or ref == mode or mode not in by_mode:
        return out
    agreed: list[float] = []  # per compared answer: the share of it equal before a difference
    theirs = by_mode[ref]
    diverged: set[int] = set()
    for (user, rnd), (qps, text) in sorted(by_mode[mode].items()):
        other = theirs.get((user, rnd))
        if other is None:
            continue
        if user in diverged:
            out["after_divergence"] += 1
            continue
        out["compared"] += 1
        first = next(
            (i for i, (a, b) in enumerate(zip(text, other[1], strict=False)) if a != b),
            min(len(text), len(other[1])),
        )
        agreed.append(1.0 if other[1] == text else first / max(1, len(other[1])))
        if other[1] != text:
            out["mismatches"] += 1
            diverged.add(user)
            if len(out["examples"]) < 5:
                out["examples"].append(
                    {"qps": qps, "user": user, "round": rnd, "first_different_char": first}
                )
    # how far answers go together before they part: where long bf16 answers all part
    # somewhere, a session parting where vLLM's own KV reuse parts is rounding, not ctxcache
    out["agreed_share_median"] = percentile(agreed, 50) if agreed else None
    return out


def compare_all(by_mode: Answers) -> dict[str, dict[str, Any]]:
    """Every mode's answers against the reference's. The other full-history and roomy modes
    are the control for the session's count: vllm-full recomputes every question as the
    reference does, in other batches; roomy reuses KV from vLLM's own prefix cache, as the
    session reuses it from the sidecar. A mismatch the controls show too is the engine's
    arithmetic (batch shapes, KV computed in other chunks), not ctxcache's."""
    out = {mode: compare(by_mode, mode) for mode in by_mode}
    return {mode: a for mode, a in out.items() if a["compared"]}


def summary(
    rows: list[dict[str, Any]], modes: list[str], points: list[Point], slo_s: float
) -> dict[str, Any]:
    cap = capacity(rows, modes)
    out: dict[str, Any] = {"slo_p95_ttft_s": slo_s, "capacity_qps": cap}
    # the most requests a second each mode got done at any offered rate: its throughput at
    # saturation where a rate it ran was more than it could keep up with
    done = {
        m: max((r["achieved_qps"] for r in rows if r["mode"] == m), default=None) for m in modes
    }
    out["most_done_qps"] = done
    # saturated: at some rate it could not keep up (less than HELD_RATE of it done), so its
    # most done is what the engine gets through, not what was offered
    out["saturated"] = {
        m: any(r["mode"] == m and r["achieved_qps"] < HELD_RATE * r["qps"] for r in rows)
        for m in modes
    }
    session = cap.get("session")
    for other in ("vllm-full-connector", "vllm-full", "roomy"):
        if other in cap and session:
            theirs = cap[other]
            # None: the other mode held no rate it ran (no finite ratio; JSON has no inf)
            out[f"session_over_{other}"] = session / theirs if theirs else None
        if done.get("session") and done.get(other):
            out[f"session_over_{other}_most_done"] = done["session"] / done[other]
    # the session's p95 where the connector-loaded vLLM stops holding the SLO
    vfc = sorted((r for r in rows if r["mode"] == "vllm-full-connector"), key=lambda r: r["qps"])
    crossed = next((r["qps"] for r in vfc if r["ttft_p95_ms"] > slo_s * 1e3), None)
    if crossed is not None:
        at = [r for r in rows if r["mode"] == "session" and r["qps"] == crossed]
        out["vllm_full_connector_crosses_slo_at_qps"] = crossed
        out["session_p95_ms_there"] = at[0]["ttft_p95_ms"] if at else None
    by_mode = answers(points)
    out["answers_by_mode"] = compare_all(by_mode)
    out["answers"] = out["answers_by_mode"].get("session") or compare(by_mode)  # the session's
    # the session against vLLM's own KV reuse: both answer from KV an earlier request made
    reuse = compare(by_mode, "session", "roomy")
    if reuse["compared"]:
        out["session_answers_vs_roomy"] = reuse
    return out


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "mode",
        "offered req/s",
        "done req/s",
        "TTFT p50 / p95 / p99 ms",
        "ITL ms",
        "output tok/s",
        "cached",
        "first / later questions TTFT p50 ms",
        "first / later p95 ms",
        "connector ms/step",
        "errors",
        "held",
        "machine_label",
    ]
    out = []
    for r in rows:
        conn = r.get("connector_ms_per_step")
        p50s = f"{r['first_ttft_p50_ms']:,.0f} / {r['later_ttft_p50_ms']:,.0f}"
        p95s = f"{r['first_ttft_p95_ms']:,.0f} / {r['later_ttft_p95_ms']:,.0f}"
        out.append(
            [
                r["mode"],
                f"{r['qps']:g}",  # (0.075, not a rounded 0.07)
                f"{r['achieved_qps']:.3g}",
                f"{r['ttft_p50_ms']:,.0f} / {r['ttft_p95_ms']:,.0f} / {r['ttft_p99_ms']:,.0f}",
                r["itl_mean_ms"],
                r["output_tokens_per_s"],
                f"{r['cached_ratio']:.0%}",
                p50s,
                p95s,
                "-" if conn is None else f"{conn:.2f}",
                r["errors"],
                "yes" if r["held"] else "no",
            ]
        )
    return markdown_table(headers, out)


def headline(summary: dict[str, Any]) -> str:
    cap = summary["capacity_qps"]
    slo = summary["slo_p95_ttft_s"]
    lines = [f"Highest offered rate held with p95 TTFT ≤ {slo:g} s:", ""]
    lines += [f"- {m}: {'none held' if q is None else f'{q:g} req/s'}" for m, q in cap.items()]
    for m, q in (summary.get("most_done_qps") or {}).items():
        if q is not None:
            where = "saturated" if summary["saturated"][m] else "kept up with every rate it ran"
            lines.append(f"- {m}: most requests done {q:.2f} req/s ({where})")
    for other in ("vllm-full-connector", "vllm-full", "roomy"):
        key = f"session_over_{other}"
        if key in summary:
            ratio = summary[key]
            lines.append(
                f"- session ÷ {other}: "
                + (f"{ratio:.2f}×" if ratio is not None else f"no ratio ({other} held no rate)")
            )
        if f"{key}_most_done" in summary:
            lines.append(f"- session ÷ {other}, most done: {summary[f'{key}_most_done']:.2f}×")
    by_mode = summary.get("answers_by_mode") or {"session": summary["answers"]}
    for mode, a in by_mode.items():
        if not a["reference"] or not a["compared"]:
            continue
        lines.append(
            f"- {mode} answers equal to {a['reference']}'s: "
            f"{a['compared'] - a['mismatches']} of {a['compared']}"
            + (
                f" ({a['after_divergence']} later rounds of diverged conversations not compared)"
                if a["after_divergence"]
                else ""
            )
            + _agreed(a)
        )
    if "session_answers_vs_roomy" in summary:
        a = summary["session_answers_vs_roomy"]
        lines.append(
            f"- session answers equal to roomy's (vLLM's own prefix cache): "
            f"{a['compared'] - a['mismatches']} of {a['compared']}" + _agreed(a)
        )
    return "\n".join(lines) + "\n"


def _agreed(a: dict[str, Any]) -> str:
    share = a.get("agreed_share_median")
    if share is None or not a["mismatches"]:
        return ""
    return f"; the median answer the same for its first {share:.0%}"


def machine_label(meta: dict[str, Any]) -> str:
    """The CPU class and vLLM's dtype a run's figure names (they change the result)."""
    machine = meta.get("machine") or {}
    return f"{machine.get('cpu_class') or 'CPU class unknown'}, vLLM {meta.get('dtype', '?')}"


def plot(
    path: Path, rows: list[dict[str, Any]], modes: list[str], slo_s: float, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11.5, 4.4))
    for mode in modes:
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["qps"])
        if not rs:
            continue
        qps = [r["qps"] for r in rs]
        left.plot(qps, [r["ttft_p95_ms"] / 1e3 for r in rs], marker="o", label=mode)
        right.plot(qps, [r["achieved_qps"] for r in rs], marker="o", label=mode)
    left.axhline(slo_s, color="grey", linestyle="--", label=f"SLO {slo_s:g} s")
    left.set(xlabel="offered req/s", ylabel="TTFT p95 (s, log)", title=f"p95 TTFT ({title})")
    left.set_yscale("log")
    top = max((r["qps"] for r in rows), default=1.0)
    right.plot([0, top], [0, top], color="grey", linestyle="--", label="offered")
    right.set(xlabel="offered req/s", ylabel="done req/s", title="requests done per second")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sent_rows(points: list[Point]) -> list[dict[str, Any]]:
    """Every request, for the JSON (answers too: a divergence can be looked at)."""
    keep = ("user", "round", "create", "index", "due", "sent", "ttft", "total", "itl", "answer")
    out = []
    for p in points:
        for s in p.sent:
            rec: dict[str, Any] = {"mode": p.mode, "qps": p.qps}
            rec |= {k: getattr(s, k) for k in keep}
            rec |= {
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "completion_tokens": s.completion_tokens,
                "error": s.error,
            }
            out.append(rec)
    return out


def points_of(data: dict[str, Any]) -> list[Point]:
    """The points of an earlier run's JSON (`sent_rows`' requests), for `--with`."""
    points: dict[tuple[str, float], Point] = {}
    fields = {f for f in Sent.__dataclass_fields__}
    for rec in data.get("requests") or []:
        key = (str(rec["mode"]), float(rec["qps"]))
        point = points.setdefault(key, Point(*key))
        point.sent.append(Sent(**{k: v for k, v in rec.items() if k in fields}))
    return list(points.values())


__all__ = [
    "Sent",
    "capacity",
    "compare",
    "headline",
    "held",
    "plot",
    "points_of",
    "row",
    "summary",
    "table",
]
