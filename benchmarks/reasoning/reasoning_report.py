"""The rows, tables, summary and plot of `ctxcache bench reasoning`: per step and per user
turn, each mode's context, recomputed tokens, TTFT and answers against `stateless`'s."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.lib.util import markdown_table
from benchmarks.multiturn.multiturn_stacks import VLLM_BLOCK
from benchmarks.reasoning.reasoning import REFERENCE, Workload

BLOCK = VLLM_BLOCK  # vLLM's KV block on CPU: reuse is counted in whole blocks
ROW_KEYS = ("turn", "step", "kind", "mode")  # a row's, not repeated in its requests


def _mean(values: list[float | int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _median(values: list[float | int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] != "create"]


def _same(rs: list[dict[str, Any]]) -> dict[str, int]:
    """How many of a session mode's answers were compared with vLLM's to the same
    conversation sent whole, and how many were the same (content and calls; reasoning;
    the prompt's length)."""
    compared = [r for r in rs if r.get("same_answer") is not None]
    return {
        "compared": len(compared),
        "same_answer": sum(1 for r in compared if r["same_answer"]),
        "same_reasoning": sum(1 for r in compared if r["same_reasoning"]),
        "same_prompt_tokens": sum(1 for r in compared if r["same_prompt_tokens"]),
    }


def rows(records: list[dict[str, Any]], modes: list[str], work: Workload) -> list[dict[str, Any]]:
    """One row per step of a user turn: each mode's means over the conversations (tokens),
    medians (times), its answers against the reference's, and its requests."""
    out = []
    steps = _steps(records)
    for u in range(1, work.turns + 1):
        for s in range(1, work.steps + 1):
            row: dict[str, Any] = {"turn": u, "step": s, "kind": work_kind(work, s)}
            for mode in modes:
                rs = [r for r in steps if (r["mode"], r["turn"], r["step"]) == (mode, u, s)]
                row[mode] = {
                    "prompt_tokens": _mean([r["prompt_tokens"] for r in rs]),
                    "cached_tokens": _mean([r["cached_tokens"] for r in rs]),
                    "recomputed_tokens": _mean([r["recomputed_tokens"] for r in rs]),
                    "loaded_tokens": _mean([r.get("loaded_tokens") for r in rs]),
                    "ttft_ms": _median([r["ttft_ms"] for r in rs]),
                    "engine_ttft_ms": _median([r.get("engine_ttft_ms") for r in rs]),
                    "completion_tokens": _mean([r["completion_tokens"] for r in rs]),
                    "reasoning_tokens": _mean([r["reasoning_tokens"] for r in rs]),
                    **(_same(rs) if mode != REFERENCE else {}),
                    "requests": [{k: v for k, v in r.items() if k not in ROW_KEYS} for r in rs],
                }
            out.append(row)
    return out


def work_kind(work: Workload, step: int) -> str:
    """Step `step` (from 1) of a user turn: `call N`, or `answer` (the text)."""
    return f"call {step}" if step <= work.calls else "answer"


def _at(steps: list[dict[str, Any]], mode: str, c: int, u: int, s: int) -> dict[str, Any] | None:
    for r in steps:
        if (r["mode"], r["conversation"], r["turn"], r["step"]) == (mode, c, u, s):
            return r
    return None


def turn_tokens(
    steps: list[dict[str, Any]], mode: str, c: int, u: int, work: Workload
) -> dict[str, int | None]:
    """At user turn u's first request, for u >= 2: `closed_turn` = its prompt less turn u-1's
    first prompt (the closed turn as the context now holds it, and the new user message: what
    the template rule recomputes, at most, besides a block); `new` = its prompt less turn
    u-1's last prompt and answer (what nothing before held: what `keep` recomputes)."""
    first, earlier = _at(steps, mode, c, u, 1), _at(steps, mode, c, u - 1, 1)
    last = _at(steps, mode, c, u - 1, work.steps)
    out: dict[str, int | None] = {"closed_turn": None, "new": None}
    if first is None or first["prompt_tokens"] is None:
        return out
    if earlier is not None and earlier["prompt_tokens"] is not None:
        out["closed_turn"] = first["prompt_tokens"] - earlier["prompt_tokens"]
    if last is not None and None not in (last["prompt_tokens"], last["completion_tokens"]):
        out["new"] = first["prompt_tokens"] - last["prompt_tokens"] - last["completion_tokens"]
    return out


def turns(records: list[dict[str, Any]], modes: list[str], work: Workload) -> list[dict[str, Any]]:
    """One row per (user turn, mode): the context at its first and last request, the tokens
    recomputed at the user message and over the turn, the bounds of `turn_tokens`, TTFT."""
    steps = _steps(records)
    out = []
    for u in range(1, work.turns + 1):
        for mode in modes:
            rs = [r for r in steps if (r["mode"], r["turn"]) == (mode, u)]
            first = [r for r in rs if r["step"] == 1]
            last = [r for r in rs if r["step"] == work.steps]
            per_conv: dict[int, int] = {}
            for r in rs:
                if r["recomputed_tokens"] is not None:
                    per_conv[r["conversation"]] = (
                        per_conv.get(r["conversation"], 0) + r["recomputed_tokens"]
                    )
            bounds = [turn_tokens(steps, mode, r["conversation"], u, work) for r in first]
            out.append(
                {
                    "turn": u,
                    "mode": mode,
                    "context_first": _mean([r["prompt_tokens"] for r in first]),
                    "context_last": _mean([r["prompt_tokens"] for r in last]),
                    "recomputed_first": _mean([r["recomputed_tokens"] for r in first]),
                    "recomputed_turn": _mean(list(per_conv.values())),
                    "closed_turn_tokens": _mean([b["closed_turn"] for b in bounds]),
                    "new_tokens": _mean([b["new"] for b in bounds]),
                    "ttft_first_ms": _median([r["ttft_ms"] for r in first]),
                    "ttft_turn_ms": _median([r["ttft_ms"] for r in rs]),
                    **(_same(rs) if mode != REFERENCE else {}),
                }
            )
    return out


def summary(records: list[dict[str, Any]], modes: list[str], work: Workload) -> dict[str, Any]:
    """What issue 58 asks of the rules, per conversation and user turn from the second:
    `template`'s recompute at the user message against the closed turn (+ a block),
    `keep`'s against the new tokens (+ a block); the answers against the reference's."""
    steps = _steps(records)
    out: dict[str, Any] = {"block_tokens": BLOCK}
    for mode in modes:
        rs = [r for r in steps if r["mode"] == mode]
        per_conv: dict[int, int] = {}
        for r in rs:
            per_conv[r["conversation"]] = per_conv.get(r["conversation"], 0) + (
                r["recomputed_tokens"] or 0
            )
        mine: dict[str, Any] = {"recomputed_per_conversation": _mean(list(per_conv.values()))}
        over_closed, over_new = [], []
        for r in rs:
            if r["step"] != 1 or r["turn"] < 2 or r["recomputed_tokens"] is None:
                continue
            b = turn_tokens(steps, mode, r["conversation"], r["turn"], work)
            if b["closed_turn"] is not None:
                over_closed.append(r["recomputed_tokens"] - b["closed_turn"])
            if b["new"] is not None:
                over_new.append(r["recomputed_tokens"] - b["new"])
        # recomputed beyond the bound at a user message (negative: within it), the worst case
        mine["recomputed_over_closed_turn_max"] = max(over_closed, default=None)
        mine["recomputed_over_new_tokens_max"] = max(over_new, default=None)
        if mode != REFERENCE:
            mine |= _same(rs)
            # the case: the first request after a new user message (turn 2 on)
            mine["at_user_messages"] = _same([r for r in rs if r["turn"] > 1 and r["step"] == 1])
            mine["after_tool_results"] = _same([r for r in rs if r["step"] > 1])
            differs = [r for r in rs if False in (r.get("same_answer"), r.get("same_reasoning"))]
            first = differs[0] if differs else None
            mine["first_difference"] = (
                None if first is None else {k: first[k] for k in ("conversation", "turn", "step")}
            )
        out[mode] = mine
    return out


def _n(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _same_cell(m: dict[str, Any]) -> str:
    if not m.get("compared"):
        return "-"
    return f"{m['same_answer']}/{m['compared']} (prompt {m['same_prompt_tokens']})"


def table(
    meta: dict[str, Any],
    rows: list[dict[str, Any]],
    turn_rows: list[dict[str, Any]],
    modes: list[str],
) -> str:
    """Per user turn and mode, then per step: context, recomputed tokens, TTFT, answers."""
    others = [m for m in modes if m != REFERENCE]
    per_turn = [
        [
            t["turn"],
            t["mode"],
            f"{_n(t['context_first'])} → {_n(t['context_last'])}",
            _n(t["recomputed_first"]),
            _n(t["recomputed_turn"]),
            _n(t["closed_turn_tokens"]),
            _n(t["new_tokens"]),
            f"{_n(t['ttft_first_ms'])} / {_n(t['ttft_turn_ms'])}",
            _same_cell(t) if t["mode"] != REFERENCE else "-",
        ]
        for t in turn_rows
    ]
    turn_headers = [
        "user turn",
        "mode",
        "context: first → last request",
        "recomputed at the user message",
        "recomputed over the turn",
        "closed turn + message",
        "new tokens",
        "TTFT ms: user message / turn median",
        "answers as vLLM's to it sent whole (same prompt length)",
    ]
    step_headers = ["turn.step"]
    step_headers += [f"{m} context / recomputed" for m in modes]
    step_headers += [f"{m} TTFT ms" for m in modes]
    step_headers += [f"{m} = whole (prompt)" for m in others]
    per_step = []
    for r in rows:
        line: list[object] = [f"{r['turn']}.{r['step']} ({r['kind']})"]
        line += [f"{_n(r[m]['prompt_tokens'])} / {_n(r[m]['recomputed_tokens'])}" for m in modes]
        line += [_n(r[m]["ttft_ms"]) for m in modes]
        line += [_same_cell(r[m]) for m in others]
        per_step.append(line)
    cpu = meta.get("cpu") or {}
    notes = [
        f"{meta['conversations']} conversations of {meta['turns']} user turns, each "
        f"{meta['calls']} forced tool calls ({meta['tool_tokens']}-token results) and a text "
        "answer, every step thinking first. Tokens: means over the conversations; TTFT: "
        "medians, to the first streamed reasoning, content or tool-call delta. Recomputed = "
        "prompt_tokens - cached_tokens. From turn 2: *closed turn + message* = the first "
        "prompt less the last turn's first prompt (what the template rule may recompute, plus "
        f"a {BLOCK}-token block); *new tokens* = the first prompt less the last request and "
        "its answer (what `keep` recomputes, plus a block; negative: the context shrank).",
        f"Answers: greedy, vLLM in {meta.get('vllm_dtype')} (asked: {meta.get('dtype_asked')}); "
        "each session step's content and tool calls compared with the same vLLM's answer to "
        "that session's conversation sent whole without a session, as a client sends it (the "
        "closed turns without their reasoning); *prompt*: how many of those had the same "
        "prompt length.",
        f"CPU: {cpu.get('model')} ({cpu.get('class', '?')}), AMX "
        f"{'yes' if cpu.get('amx') else 'no'}, avx512_bf16 "
        f"{'yes' if cpu.get('avx512_bf16') else 'no'}; reasoning parser "
        f"{meta.get('reasoning_parser') or 'the default'}.",
    ]
    notes += [f"**{mode} failed:** {error}" for mode, error in (meta.get("errors") or {}).items()]
    return (
        markdown_table(turn_headers, per_turn)
        + "\n\n"
        + markdown_table(step_headers, per_step)
        + "\n\n"
        + "\n".join(notes)
        + "\n"
    )


def plot(
    path: Path, records: list[dict[str, Any]], modes: list[str], work: Workload, title: str
) -> None:
    """Per request of a conversation (means over the conversations): the context, the
    tokens recomputed and the TTFT, a line per mode; dotted lines at each user message."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _steps(records)
    xs = list(range(1, work.turns * work.steps + 1))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, what in (
        (axes[0], "prompt_tokens", "context (prompt tokens)"),
        (axes[1], "recomputed_tokens", "recomputed tokens (prompt - cached)"),
        (axes[2], "ttft_ms", "TTFT, ms (median)"),
    ):
        for mode in modes:
            ys = []
            for x in xs:
                u, s = (x - 1) // work.steps + 1, (x - 1) % work.steps + 1
                rs = [r[key] for r in steps if (r["mode"], r["turn"], r["step"]) == (mode, u, s)]
                ys.append((_median if key == "ttft_ms" else _mean)(rs))
            if all(y is None for y in ys):
                continue
            ax.plot(xs, [float("nan") if y is None else y for y in ys], marker="o", label=mode)
        for u in range(work.turns):
            ax.axvline(u * work.steps + 1, color="grey", linestyle=":", linewidth=0.8)
        ax.set(xlabel="request (dotted: a user message)", title=what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"past reasoning in a session: template vs keep vs stateless ({title})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
