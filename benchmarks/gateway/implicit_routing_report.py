"""The rows, tables and plot of `ctxcache bench implicit-routing`
(benchmarks/gateway/implicit_routing.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.lib.util import bar_plot, markdown_table, percentile

if TYPE_CHECKING:
    from benchmarks.gateway.implicit_routing import Record

BLOCK = 16  # the workers' L1 block: a prefix is reused up to its last whole block


def p50(records: Sequence[Record]) -> float:
    return round(percentile([r.ttft_ms for r in records], 50), 1)


def mean(values: Sequence[int]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


def rows(records: Sequence[Record], prefix_tokens: int) -> list[dict[str, Any]]:
    """A row per way (its conversations), then a row per routing check: the keyed way's
    keys, the load check's new conversations while the prefix's worker was busy and the
    one after."""
    reused_at = prefix_tokens // BLOCK * BLOCK  # (the rest shares a block with the question)
    out: list[dict[str, Any]] = []
    ways = list(dict.fromkeys(r.way for r in records))
    for way in ways:
        main = [r for r in records if r.way == way and r.phase == "main"]
        firsts = [r for r in main if r.turn == 0]
        # the conversations that could fork another's system prompt: all but the first (keyed:
        # a user's second ones; a key's states are its own)
        first = [r for r in firsts if r.conversation == "c0" or r.conversation.endswith("-c0")]
        new = [r for r in firsts if r not in first]
        computed = [r for r in main if r.cached_tokens < reused_at]  # the system prompt
        later = [r for r in main if r.turn > 0]
        by_worker = Counter(r.worker for r in main)
        out.append(
            {
                "way": way,
                "requests": len(main),
                "by_worker": dict(sorted(by_worker.items())),
                "implicit": dict(Counter(r.result for r in main)),
                "computed_ttft_p50_ms": p50(computed),
                "new_conversations": len(new),
                "new_reused_prefix": sum(r.cached_tokens >= reused_at for r in new),
                "new_cached_mean": mean([r.cached_tokens for r in new]),
                "new_prompt_mean": mean([r.prompt_tokens for r in new]),
                "new_ttft_p50_ms": p50(new),
                "later_turns": len(later),
                "later_cached_share": (
                    round(
                        sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later), 3
                    )
                    if later
                    else None
                ),
                "later_ttft_p50_ms": p50(later),
                "later_on_first_worker": sum(r.worker == r.first_worker for r in later),
                # every request: those that computed the system prompt, and the prompt
                # tokens computed in all (prompt - cached)
                "prefix_computed": len(computed),
                "tokens_computed": sum(r.prompt_tokens - r.cached_tokens for r in main),
                "ttft_sum_s": round(sum(r.ttft_ms for r in main) / 1e3, 1),
            }
        )
    keyed = [r for r in records if r.way == "keyed"]
    if keyed:
        keys: dict[str, set[str]] = {}
        for r in keyed:
            keys.setdefault(str(r.key), set()).add(r.worker)
        out.append(
            {
                "check": "keys",
                "requests": len(keyed),
                "keys": {k: sorted(v) for k, v in sorted(keys.items())},
                "keys_on_one_worker": sum(len(v) == 1 for v in keys.values()),
                "by_worker": dict(sorted(Counter(r.worker for r in keyed).items())),
            }
        )
    for phase in ("busy", "after"):
        probes = [r for r in records if r.phase == phase]
        if not probes:
            continue
        owner = next(r.worker for r in records if r.way == "implicit" and r.phase == "main")
        out.append(
            {
                "check": phase,
                "prefix_worker": owner,
                "requests": len(probes),
                "by_worker": dict(sorted(Counter(r.worker for r in probes).items())),
                "inflight_before": [r.inflight for r in probes],
                "reused_prefix": sum(r.cached_tokens >= reused_at for r in probes),
                "cached": [r.cached_tokens for r in probes],
                "cached_mean": mean([r.cached_tokens for r in probes]),
                "l1_mean": mean([r.l1_tokens for r in probes]),
                "sidecar_mean": mean([r.sidecar_tokens for r in probes]),
                "ttft_p50_ms": p50(probes),
            }
        )
    return out


def _workers(by_worker: dict[str, int]) -> str:
    return " / ".join(f"{w} {n}" for w, n in by_worker.items())


def _results(counts: dict[str, int]) -> str:
    shown = [f"{k} {v}" for k, v in counts.items() if v]
    return ", ".join(shown) or "none"


def table(meta: dict[str, Any], out_rows: Sequence[dict[str, Any]]) -> str:
    ways = [r for r in out_rows if "way" in r]
    checks = {r["check"]: r for r in out_rows if "check" in r}
    prefix = meta["prefix_tokens"]
    lines = [
        f"{meta['conversations']} new conversations a way (no `session_id`), {meta['turns']} "
        f"requests each, one at a time, sharing a {prefix}-token system prompt (rendered alone); "
        f"`max_tokens` {meta['max_tokens']}, two built-in workers on `{Path(meta['model']).name}`; "
        f"load average {meta['load_avg_1m_end']} at the end.",
        "",
        markdown_table(
            [
                "way",
                "requests by worker",
                "gateway's implicit results",
                "new conversations after the first: system prompt reused",
                "their cached tokens (of prompt), mean",
                "later turns: cached share",
                "later turns on their conversation's worker",
                "requests that computed the system prompt",
                "prompt tokens computed",
            ],
            [
                [
                    r["way"],
                    _workers(r["by_worker"]),
                    _results(r["implicit"]),
                    f"{r['new_reused_prefix']} / {r['new_conversations']}",
                    f"{r['new_cached_mean']:,.0f} ({r['new_prompt_mean']:,.0f})",
                    _share(r["later_cached_share"]),
                    f"{r['later_on_first_worker']} / {r['later_turns']}",
                    f"{r['prefix_computed']} / {r['requests']}",
                    f"{r['tokens_computed']:,}",
                ]
                for r in ways
            ],
        ),
        "",
        markdown_table(
            [
                "way",
                "TTFT p50: requests that computed the system prompt",
                "new conversations after the first",
                "later turns",
                "every request, sum",
            ],
            [
                [
                    r["way"],
                    f"{r['computed_ttft_p50_ms']:,.0f} ms",
                    f"{r['new_ttft_p50_ms']:,.0f} ms",
                    f"{r['later_ttft_p50_ms']:,.0f} ms",
                    f"{r['ttft_sum_s']:,.1f} s",
                ]
                for r in ways
            ],
        ),
    ]
    by_way = {r["way"]: r for r in ways}
    if {"implicit", "passthrough"} <= by_way.keys():
        a, b = by_way["implicit"], by_way["passthrough"]
        lines += [
            "",
            f"passthrough / implicit: TTFT p50 of new conversations "
            f"{_ratio(b['new_ttft_p50_ms'], a['new_ttft_p50_ms'])}, of later turns "
            f"{_ratio(b['later_ttft_p50_ms'], a['later_ttft_p50_ms'])}; prompt tokens "
            f"computed {_ratio(b['tokens_computed'], a['tokens_computed'])}; TTFT summed over "
            f"every request {_ratio(b['ttft_sum_s'], a['ttft_sum_s'])}.",
        ]
    if checks:
        lines += [
            "",
            markdown_table(
                ["routing check", "requests", "went to", "what it shows"], _checks(checks, meta)
            ),
        ]
    return "\n".join(lines) + "\n"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _checks(checks: dict[str, dict[str, Any]], meta: dict[str, Any]) -> list[list[str]]:
    out = []
    if "keys" in checks:
        k = checks["keys"]
        spread = ", ".join(f"{key} {'/'.join(w)}" for key, w in k["keys"].items())
        out.append(
            [
                "keyed: `prompt_cache_key` per user",
                str(k["requests"]),
                _workers(k["by_worker"]),
                f"every request of a key on one worker: {k['keys_on_one_worker']} / "
                f"{len(k['keys'])} keys ({spread})",
            ]
        )
    slack = meta["imbalance_slack"]
    for phase, what in (("busy", "busy"), ("after", "free again")):
        if phase not in checks:
            continue
        c = checks[phase]
        inflight = ", ".join(_workers(i or {}) for i in c["inflight_before"])
        name = f"load bound: {c['prefix_worker']} (the prefix's) {what}" + (
            f", {slack + 1} streams (slack {slack})" if phase == "busy" else ""
        )
        out.append(
            [
                name,
                str(c["requests"]),
                _workers(c["by_worker"]),
                f"in flight before each: {inflight}; cached tokens "
                f"{', '.join(f'{n:,}' for n in c['cached'])} (of {meta['prefix_tokens']:,} "
                f"shared; mean L1 {c['l1_mean']:,.0f}, sidecar {c['sidecar_mean']:,.0f}); "
                f"TTFT p50 {c['ttft_p50_ms']:,.0f} ms",
            ]
        )
    return out


def plot(path: Path, out_rows: Sequence[dict[str, Any]], title: str) -> None:
    ways = [r for r in out_rows if "way" in r]
    bar_plot(
        path,
        f"Sessionless conversations, two workers ({title})",
        [r["way"] for r in ways],
        {
            "new conversations' first request, TTFT p50": [r["new_ttft_p50_ms"] for r in ways],
            "later turns, TTFT p50": [r["later_ttft_p50_ms"] for r in ways],
        },
        "ms",
    )
