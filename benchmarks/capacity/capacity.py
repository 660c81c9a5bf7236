"""`ctxcache bench capacity`: how many requests per second one engine holds at a latency
target — ctxcache sessions against vLLM at its best, one engine at a time.

The workload is multi-round QA (`capacity_load.py`): `--users` conversations at once, each
arriving with a shared system prompt and a long history of its own, asking `--rounds`
questions with `--answer-tokens`-token answers, replaced by a new user when done. The sizes
default to a named `--workload` (`WORKLOADS`): `long`, where one prefill is a large part of
a turn on every CPU class (issue 59), or `short`, every run before it. For each mode, the
engine is started alone, the offered rate climbs through `--qps`, and each rate runs until
`--requests` questions (after `--warmup` more) are sent. A rate is **held** when its p95
time to first token is within `--slo` and at least 90% of it was achieved with no error;
the headline is the highest rate each mode held. A mode's sweep stops after its first rate
that is not held (`--keep-going` runs them all). `--with` merges an earlier run's modes
(the same workload) into this run's report, so each mode can sweep rates of its own.

Modes (`benchmarks/multiturn/multiturn_stacks.py` starts them; every vLLM gets the same
model, dtype, threads, CPU reservation and scheduler settings):
- `vllm-full`: vLLM alone, the whole conversation every question, its own prefix cache;
- `vllm-full-connector`: the same vLLM with the ctxcache connector loaded and idle (no
  request carries a session): the same engine configuration as `session`;
- `session`: the ctxcache gateway, vLLM with the connector, the sidecar: a create per user,
  then the new question only;
- `roomy`: vLLM alone with a KV cache that holds every conversation: the floor.

Per mode and rate: requests done per second, TTFT p50/p95/p99, inter-token latency, output
tokens per second, the cached share of prompt tokens, creates, errors, and the engine's time
in connector work per step (from vLLM's `/metrics`). Every answer of the other modes is
compared with the same engine's (`vllm-full-connector`) full-history answer for the same user
and round: the session's is the check, vllm-full's and roomy's the controls (how often the
engine's own batching and prefix cache change a greedy answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from argparse import Namespace
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.capacity.capacity_load import Driver, Point, Texts, Workload
from benchmarks.lib.util import (
    add_output_arguments,
    ensure_preset,
    plot_path,
    run_meta,
    write_outputs,
)
from benchmarks.multiturn.multiturn import DEFAULT_MODEL
from ctxcache.cpu import DTYPES, given_dtype, vllm_dtype

NAME = "capacity"
MODES = ("vllm-full", "vllm-full-connector", "session", "roomy")

# The named workloads: the defaults of the size options (an option given still wins).
# `long` is where a context cache matters on every CPU class (issue 59): a ~5,100-token
# first prompt growing to ~6,600 over eight questions (the small preset's window is 8,192),
# 100-token answers as production-stack's multi-round QA, and a KV cache of 160 blocks of
# 128 tokens: about three conversations. Its first question is a full prefill in every mode
# (several seconds on 2 CPUs), so the SLO is 10 s. `short` is every run before it.
WORKLOADS: dict[str, dict[str, Any]] = {
    "long": {
        "users": 6,
        "rounds": 8,
        "system_tokens": 1000,
        "history_tokens": 4000,
        "question_tokens": 115,
        "answer_tokens": 100,
        "kv_blocks": 160,
        "max_model_len": 8192,
        "slo": 10.0,
        "requests": 24,
        "warmup": "2x",  # two questions per user
        "qps": "0.05,0.075,0.1,0.125,0.15,0.2,0.25,0.3,0.4,0.5",
    },
    "short": {
        "users": 12,
        "rounds": 5,
        "system_tokens": 200,
        "history_tokens": 900,
        "question_tokens": 115,
        "answer_tokens": 32,
        "kv_blocks": 48,
        "max_model_len": 4096,
        "slo": 2.0,
        "requests": 48,
        "warmup": "lifetime",  # users x rounds
        "qps": "0.25,0.5,0.75,1,1.25,1.5,2,2.5,3,4",
    },
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL / "models" / "small",
        help="local model dir (the preset named by --preset is built there if missing)",
    )
    p.add_argument("--preset", choices=("tiny", "small"), default="small")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument(
        "--workload",
        choices=tuple(WORKLOADS),
        default="long",
        help="the named workload whose sizes the options below default to: `long` (since "
        "issue 59: ~5,000-token contexts, 100-token answers, a KV cache of about three "
        "conversations, SLO 10 s) or `short` (every run in docs/benchmarks.md before it: "
        "~1,100-token contexts, 32-token answers, SLO 2 s)",
    )
    p.add_argument("--users", type=int, default=None, help="conversations at once")
    p.add_argument("--rounds", type=int, default=None, help="questions per user")
    p.add_argument("--system-tokens", type=int, default=None, help="shared system prompt")
    p.add_argument("--history-tokens", type=int, default=None, help="each user's own history")
    p.add_argument("--question-tokens", type=int, default=None)
    p.add_argument("--answer-tokens", type=int, default=None)
    p.add_argument("--qps", default=None, help="offered rates to sweep (req/s)")
    p.add_argument("--requests", type=int, default=None, help="questions measured per rate")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="questions sent before measuring (default: the workload's; `short`'s is --users x "
        "--rounds, one lifetime of the first users, `long`'s two questions per user: the "
        "measured questions must come after the start's backlog of first questions)",
    )
    p.add_argument("--slo", type=float, default=None, help="p95 TTFT target, seconds")
    p.add_argument("--keep-going", action="store_true", help="run every rate of every mode")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="vLLM's --dtype (auto: by the CPU, bfloat16 with AMX or avx512_bf16, else float32; "
        "the runs in docs/benchmarks.md before 2026-11-28 are float32, the default then)",
    )
    p.add_argument("--kv-blocks", type=int, default=None, help="vLLM's KV cache in blocks")
    p.add_argument("--roomy-gib", type=int, default=2, help="the roomy vLLM's KV cache, GiB")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--reserved-cpus",
        type=int,
        default=None,
        help="CPUs vLLM keeps off its compute threads (VLLM_CPU_NUM_OF_RESERVED_CPU), the same "
        "for every mode; default: `ctxcache vllm`'s (docs/vllm.md)",
    )
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="ARG", help="more vLLM arguments"
    )
    p.add_argument(
        "--async-loads",
        action="store_true",
        help="the session's connector loads KV beside vLLM's steps (`ctxcache vllm --async-loads`)",
    )
    p.add_argument(
        "--create-priority",
        type=int,
        default=None,
        help="the session's vLLM schedules by priority, the gateway's creates at this one and "
        "turns at 0 (lower first: 1 puts turns ahead of new conversations' prefills)",
    )
    p.add_argument(
        "--separate-create",
        action="store_true",
        help="the session's users arrive with a prefill-only create and ask their first "
        "question as a turn (two requests), not in a streamed create (one)",
    )
    p.add_argument(
        "--with",
        dest="merge",
        action="append",
        default=[],
        type=Path,
        metavar="JSON",
        help="an earlier run's capacity.json of the same workload, other modes: its rows and "
        "answers join this run's report (the ratios, the answer check, the plot), so each "
        "mode can sweep rates of its own",
    )
    p.add_argument(
        "--rate-offset",
        type=int,
        default=0,
        help="number this run's rates from this index on (rate i's users from (offset + i) x "
        f"{USERS_PER_RATE:,}): a run that goes on with a mode's sweep at higher rates, merged "
        "with --with, then meets users of its own",
    )
    p.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=None,
        metavar="JSON",
        help="run nothing: judge an earlier run's rows again at --slo (default its own) and "
        "write its report to --out (a rate's p95 does not depend on the SLO)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI size: the `short` workload on the tiny preset, 3 users, 2 rounds, 2 rates, "
        "6 requests each",
    )
    add_output_arguments(p, NAME)


def main(args: Namespace) -> int:
    from benchmarks.capacity import capacity_report as report
    from ctxcache.logs import setup_logging
    from ctxcache.vllm_engine import auto_reserved_cpus

    setup_logging("bench", "WARNING")
    if args.source is not None:
        return judge(args.source, args.slo, Path(args.out), args.plot, NAME)
    if args.quick:
        _quick(args)
    _workload_defaults(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        sys.stderr.write(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}\n")
        return 2
    rates = rates_of(args.qps)
    if rates is None:
        return 2
    warmup = args.warmup
    model = _model(args)
    workload = Workload(
        users=args.users,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        history_tokens=args.history_tokens,
        question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens,
    )
    texts = Texts(workload, _tokenizer(model), args.seed)
    dtype = pin_dtype(args)
    modes, rows, points = sweep_all(
        args, modes, model, texts, rates, warmup, vars(workload), dtype.dtype
    )
    summary = report.summary(rows, modes, points, args.slo)
    meta = run_meta(
        NAME,
        workload_name=args.workload,
        model=str(model),
        modes=modes,
        workload=vars(workload),
        qps=rates,
        requests=args.requests,
        warmup=warmup,
        slo_s=args.slo,
        dtype=dtype.dtype,
        kv_blocks=args.kv_blocks,
        roomy_gib=args.roomy_gib,
        max_model_len=args.max_model_len,
        reserved_cpus=auto_reserved_cpus() if args.reserved_cpus is None else args.reserved_cpus,
        vllm_args=args.vllm_arg,
        async_loads=args.async_loads,
        create_priority=args.create_priority,
        separate_create=args.separate_create,
        seed=args.seed,
        merged=[str(p) for p in args.merge],
        title=f"{args.users} users, {_context(workload)}",
    )
    data = {"meta": meta, "summary": summary, "results": rows, "requests": report.sent_rows(points)}
    text = report.headline(summary) + "\n" + report.table(rows)
    paths = write_outputs(Path(args.out), NAME, data, text)
    png = plot_path(args, NAME)
    title = f"{meta['title']}; {report.machine_label(meta)}"
    report.plot(png, rows, modes, args.slo, title)
    for path in [*paths, png]:
        sys.stdout.write(f"{path}\n")
    sys.stdout.write(report.headline(summary))
    return 0


def rates_of(text: str) -> list[float] | None:
    """`--qps`'s rates, in order; None (and a line on stderr) when they are not positive."""
    try:
        rates = sorted({float(q) for q in text.split(",") if q.strip()})
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0:
        sys.stderr.write("--qps: positive rates, comma-separated\n")
        return None
    return rates


def pin_dtype(args: Namespace) -> Any:
    """vLLM's dtype for this run (by the CPU unless given), put in `--vllm-arg` so every
    mode's engine gets the same; `args.engine` set to the vLLM stack."""
    args.engine = "vllm"  # multiturn_stacks' vLLM stack
    dtype = vllm_dtype(args.dtype, args.vllm_arg)
    if given_dtype(args.vllm_arg) is None:
        args.vllm_arg = ["--dtype", dtype.dtype, *args.vllm_arg]
    return dtype


def sweep_all(
    args: Namespace,
    modes: list[str],
    model: Path,
    texts: Any,
    rates: list[float],
    warmup: int,
    workload: dict[str, Any],
    dtype: str,
    driver: Callable[[Any, str], Driver] | None = None,
) -> tuple[list[str], list[dict[str, Any]], list[Point]]:
    """Every mode, one engine at a time, then the earlier runs of `--with` merged in
    (`dtype`: vLLM's, as `pin_dtype` pinned it)."""
    points: list[Point] = []
    rows: list[dict[str, Any]] = []
    for mode in modes:  # one engine at a time
        got = sweep(args, mode, model, texts, rates, warmup, driver)
        points += [p for p, _ in got]
        rows += [r for _, r in got]
    same = {
        "workload": workload,
        "dtype": dtype,
        "kv_blocks": args.kv_blocks,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
        "slo_s": args.slo,
    }
    return merged(args.merge, modes, rows, points, same)


def sweep(
    args: Namespace,
    mode: str,
    model: Path,
    texts: Texts,
    rates: list[float],
    warmup: int,
    driver: Callable[[Any, str], Driver] | None = None,
) -> list[tuple[Point, dict[str, Any]]]:
    """One mode's engine, alone, through the rates (until one is not held). `driver`: the
    driver of a rate from the mode's servers (`multiturn_stacks.Mode`) and the served model
    name (default: this benchmark's; `bench agents --capacity` gives its own)."""
    from tqdm import tqdm

    from benchmarks.capacity import capacity_report as report
    from benchmarks.multiturn.multiturn_stacks import start

    out: list[tuple[Point, dict[str, Any]]] = []
    args.out = Path(args.out)
    with start(args, [mode], model, log_name=f"servers-{mode}.log") as (stack, sup):
        m = stack[0]
        name = _served_name(m.url)
        for i, qps in enumerate(rates):
            if sup.stopping.is_set():
                raise KeyboardInterrupt
            if driver is None:
                separate = args.separate_create
                rate = Driver(mode, m.url, name, texts, session=m.session, separate_create=separate)
            else:
                rate = driver(m, name)
            before = _scrape(m.engine)
            with tqdm(
                total=warmup + args.requests, desc=f"{mode} @ {qps:g} req/s", unit="req"
            ) as bar:
                first = (getattr(args, "rate_offset", 0) + i) * USERS_PER_RATE
                run = rate.run(qps, args.requests, warmup, bar.update, first)
                point = asyncio.run(run)
            r = report.row(point, warmup, args.slo)
            r |= _connector(before, _scrape(m.engine))
            out.append((point, r))
            sys.stderr.write(
                f"{mode} @ {qps:g} req/s: done {r['achieved_qps']:.2f} req/s, TTFT p95 "
                f"{r['ttft_p95_ms']:,.0f} ms, errors {r['errors']}, held: {r['held']}\n"
            )
            if not r["held"] and not args.keep_going:
                break
    return out


# each rate's users are numbered from its index times this (more than a rate's users), so no
# engine has seen a rate's conversations before; every mode gets the same ones at a rate
USERS_PER_RATE = 100_000

# vLLM's counters read before and after each rate
_METRICS = (
    "vllm:iteration_tokens_total_count",
    "vllm:ctxcache_load_ms_total",
    "vllm:ctxcache_store_copy_ms_total",
    "vllm:ctxcache_lookup_us_total",
    "vllm:ctxcache_loaded_tokens_total",
    "vllm:ctxcache_load_failures_total",
    "vllm:num_preemptions_total",
)


def _scrape(engine: str) -> dict[str, float]:
    import httpx

    try:
        text = httpx.get(f"{engine}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {"connector": float("vllm:ctxcache_" in text)}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _METRICS:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _connector(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Engine steps during the rate and the connector's share of them."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("vllm:iteration_tokens_total_count")
    work_ms = (
        delta("vllm:ctxcache_load_ms_total")
        + delta("vllm:ctxcache_store_copy_ms_total")
        + delta("vllm:ctxcache_lookup_us_total") / 1e3
    )
    loaded = bool(after.get("connector"))
    return {
        "engine_steps": steps,
        "connector_ms": work_ms if loaded else None,
        "connector_ms_per_step": work_ms / steps if loaded and steps else None,
        "loaded_tokens": delta("vllm:ctxcache_loaded_tokens_total") if loaded else None,
        "load_failures": delta("vllm:ctxcache_load_failures_total") if loaded else None,
        "preemptions": delta("vllm:num_preemptions_total"),
    }


def _served_name(url: str) -> str:
    import httpx

    r = httpx.get(f"{url}/v1/models", timeout=30)
    r.raise_for_status()
    return str(r.json()["data"][0]["id"])


# `--quick`: the CI size; an option given explicitly still wins
QUICK: dict[str, Any] = {
    "workload": "short",
    "preset": "tiny",
    "users": 3,
    "rounds": 2,
    "requests": 6,
    "warmup": 2,
    "system_tokens": 40,
    "history_tokens": 200,
    "question_tokens": 30,
    "answer_tokens": 8,
    "qps": "1,2",
    "keep_going": True,
}


def _quick(args: Namespace) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)  # its defaults tell an option given from one left alone
    for name, value in QUICK.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
    if args.model == parser.get_default("model"):
        args.model = DEFAULT_MODEL / "models" / "tiny"


def judge(
    source: Path, slo: float | None, out: Path, plot: str | None, name: str, extra: str = ""
) -> int:
    """`--from`: an earlier run's rows judged again at `slo` (its own when None), its summary,
    report and plot written to `out`. A stricter SLO than the run's own is sound: a sweep
    stops at its first rate not held, so it ran every rate a stricter one holds."""
    from benchmarks.capacity import capacity_report as report

    data = json.loads(source.read_text())
    meta = data["meta"]
    slo = float(meta["slo_s"] if slo is None else slo)
    if slo > float(meta["slo_s"]):
        raise SystemExit(
            f"--from {source}: --slo above its own {meta['slo_s']:g} s (its sweeps "
            "stopped at the first rate that SLO did not hold)"
        )
    rows = [r | {"held": report.held(r, slo)} for r in data["results"]]
    modes = [str(m) for m in meta["modes"]]
    points = report.points_of(data)
    summary = {**data["summary"], **report.summary(rows, modes, points, slo)}
    meta = meta | {"slo_s": slo, "judged_from": str(source), "judged_at": run_meta(name)}
    data = data | {"meta": meta, "summary": summary, "results": rows}
    again = (
        f"Judged again at p95 TTFT ≤ {slo:g} s from `{source}`: `{meta['judged_at']['command']}`"
    )
    text = again + "\n\n" + report.headline(summary) + "\n" + report.table(rows) + extra
    paths = write_outputs(out, name, data, text)
    png = Path(plot) if plot else out / f"{name}.png"
    title = f"{meta.get('title') or _title(meta.get('workload') or {}, name)}"
    title += f"; {report.machine_label(meta)}"
    report.plot(png, rows, modes, slo, title)
    for path in [*paths, png]:
        sys.stdout.write(f"{path}\n")
    sys.stdout.write(report.headline(summary))
    return 0


def merged(
    paths: list[Path],
    modes: list[str],
    rows: list[dict[str, Any]],
    points: list[Point],
    same: dict[str, Any],
) -> tuple[list[str], list[dict[str, Any]], list[Point]]:
    """This run's modes, rows and points after those of earlier runs (`--with`): each must
    have the values of `same` in its meta (the workload, engine sizes, dtype, seed, SLO: else
    its conversations or engines are not this run's), and no mode at a rate or with users this
    run has too (a mode's sweep can go on in a later run: `--rate-offset`)."""
    from benchmarks.capacity import capacity_report as report

    for path in paths:
        data = json.loads(path.read_text())
        meta = data["meta"]
        differ = [k for k, v in same.items() if meta.get(k) != v]
        if differ:
            raise SystemExit(f"--with {path}: not this run's {', '.join(differ)}")
        old = [str(m) for m in meta["modes"]]
        theirs = report.points_of(data)
        mine = {(p.mode, p.qps) for p in points}
        users = {(p.mode, s.user) for p in points for s in p.sent}
        if any((p.mode, p.qps) in mine for p in theirs):
            raise SystemExit(f"--with {path}: it ran a mode at a rate this run ran too")
        if any((p.mode, s.user) in users for p in theirs for s in p.sent):
            raise SystemExit(f"--with {path}: a mode met the same users (--rate-offset)")
        modes = [*old, *(m for m in modes if m not in old)]
        rows, points = [*data["results"], *rows], [*theirs, *points]
    return modes, rows, points


def _workload_defaults(args: Namespace) -> None:
    """Every size option left unset takes the named workload's value."""
    for name, value in WORKLOADS[args.workload].items():
        if getattr(args, name) is not None:
            continue
        if name == "warmup":
            value = args.users * (2 if value == "2x" else args.rounds)
        setattr(args, name, value)


def _model(args: Namespace) -> Path:
    return ensure_preset(args.preset, args.model)


def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def _title(workload: dict[str, Any], name: str) -> str:
    """A figure's title from a run's workload (runs written before `meta.title`)."""
    if "users" in workload and "history_tokens" in workload:
        return f"{workload['users']} users, {_context(Workload(**workload))}"
    if "agents" in workload:
        w = workload
        return f"{w['agents']} agents, {w['steps']} steps x {w['tool_tokens']}-token results"
    return name


def _context(w: Workload) -> str:
    start = w.system_tokens + w.history_tokens
    end = start + w.rounds * w.question_tokens + (w.rounds - 1) * w.answer_tokens
    return f"context ~{start:,}→{end:,} tokens"
