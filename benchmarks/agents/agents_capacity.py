"""`ctxcache bench agents --capacity`: how many requests per second of many agents one
engine holds at a p95 TTFT target, one engine at a time (`bench capacity`'s machinery).

`--agents` agent loops at once (`agents_load.py`: a shared system prompt and two tools, a
task of its own, `--steps` forced tool calls each answered by a `--tool-tokens` result, one
text answer), each replaced by a new agent when done, at each offered rate of `--qps`; each
mode's engine is started alone (`multiturn_stacks.start`, as `bench capacity` does) and
swept through the rates by `capacity.sweep` with an agent's driver. The rows, the held
rates (p95 TTFT ≤ `--slo`, ≥ 90% of the rate achieved, no error), the ratios, the answer
check against `vllm-full-connector` and the plot are `capacity_report`'s; beside them, each
mode's mean prompt tokens per step (a session's history keeps the tokens generated for a
call, the full-history modes resend it as the template renders it: the prompts differ from
the second step on, and so may the answers).

Modes: `vllm-full`, `vllm-full-connector`, `session` and `stateless-gateway` (the whole
conversation through the gateway, no `session_id`: its implicit sessions), as `bench
capacity` and `bench multiturn` define them. The defaults are CAPACITY (one place to
change them); `--quick` is QUICK (the tiny preset, CI-sized).
"""

from __future__ import annotations

import argparse
import json
import sys
from argparse import Namespace
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.agents.agents_load import AgentDriver, AgentTexts, AgentWorkload
from benchmarks.capacity.capacity_load import Point

NAME = "agents-capacity"
MODES = ("vllm-full", "vllm-full-connector", "session", "stateless-gateway")

# the defaults of `--capacity` (None in the parser: an option given always wins)
CAPACITY: dict[str, Any] = {
    "preset": "small",
    "modes": "vllm-full-connector,session",
    "agents": 8,
    "steps": 8,  # ~1,600 tokens growing to ~6,800 on the small preset (600-token results)
    "tool_tokens": 600,
    "system_tokens": 1000,
    "task_tokens": 200,
    "qps": "0.1,0.15,0.2,0.25,0.3,0.4,0.5,0.6,0.8",
    "requests": 24,
    "warmup": None,  # two requests per agent
    # a full-history step prefills up to ~6,800 tokens: seconds on 2 CPUs in any mode with
    # nothing else running, so the target is `bench capacity --workload long`'s
    "slo": 10.0,
    "kv_blocks": 160,  # 160 x 128 tokens: about three agents' conversations
    "max_model_len": 8192,
}
# `--quick`: CI size, over CAPACITY (an option given explicitly still wins)
QUICK: dict[str, Any] = {
    "preset": "tiny",
    "agents": 2,
    "steps": 2,
    "tool_tokens": 60,
    "system_tokens": 100,
    "task_tokens": 30,
    "qps": "1,2",
    "requests": 6,
    "warmup": 2,
    "kv_blocks": 48,
    "max_model_len": 4096,
    "keep_going": True,
}


def add_capacity_arguments(p: argparse.ArgumentParser) -> None:
    """`bench agents`' options of `--capacity` (beside the loop's that it shares: --steps,
    --tool-tokens, --warmup, --kv-blocks, --max-model-len, --dtype, --quick, ...)."""
    g = p.add_argument_group("--capacity (many agents at an offered rate)")
    g.add_argument(
        "--capacity",
        action="store_true",
        help="many agents interleaved at offered rates, one engine at a time: the highest "
        "rate each mode holds at p95 TTFT <= --slo (docs/benchmarks.md)",
    )
    g.add_argument(
        "--modes", default=None, help=f"comma-separated: {', '.join(MODES)} ({CAPACITY['modes']})"
    )
    g.add_argument(
        "--agents", type=int, default=None, help=f"agents at once ({CAPACITY['agents']})"
    )
    g.add_argument(
        "--system-tokens",
        type=int,
        default=None,
        help=f"shared system prompt ({CAPACITY['system_tokens']})",
    )
    g.add_argument(
        "--task-tokens",
        type=int,
        default=None,
        help=f"each agent's task ({CAPACITY['task_tokens']})",
    )
    g.add_argument("--qps", default=None, help=f"offered rates to sweep, req/s ({CAPACITY['qps']})")
    g.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests measured per rate ({CAPACITY['requests']})",
    )
    g.add_argument(
        "--slo", type=float, default=None, help=f"p95 TTFT target, seconds ({CAPACITY['slo']:g})"
    )
    g.add_argument("--keep-going", action="store_true", help="run every rate of every mode")
    g.add_argument(
        "--with",
        dest="merge",
        action="append",
        default=[],
        type=Path,
        metavar="JSON",
        help="an earlier run's agents-capacity.json of the same workload: its rows and "
        "answers join this run's report (each mode can sweep rates of its own)",
    )
    g.add_argument(
        "--from",
        dest="source",
        type=Path,
        default=None,
        metavar="JSON",
        help="run nothing: judge an earlier run's rows again at --slo (at most its own) and "
        "write its report to --out",
    )
    g.add_argument(
        "--rate-offset",
        type=int,
        default=0,
        help="number this run's rates from this index on, so a mode's sweep going on in a "
        "later run (merged with --with) meets agents of its own",
    )


def resolve(args: Namespace) -> None:
    """CAPACITY (with --quick, QUICK over it) for every option not given."""
    from benchmarks.agents.agents import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)  # its defaults tell an option given from one left alone
    for name, value in CAPACITY.items():
        if getattr(args, name) == parser.get_default(name):
            setattr(args, name, value)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == CAPACITY.get(name, parser.get_default(name)):
                setattr(args, name, value)
    if args.warmup is None:
        args.warmup = 2 * args.agents


def main(args: Namespace) -> int:
    from benchmarks.agents.agents import cpu_info
    from benchmarks.capacity import capacity_report as report
    from benchmarks.capacity.capacity import pin_dtype, rates_of, sweep_all
    from benchmarks.lib.util import ensure_preset, plot_path, run_meta, write_outputs
    from benchmarks.multiturn.multiturn import DEFAULT_MODEL
    from ctxcache.logs import setup_logging
    from ctxcache.vllm_engine import default_tool_parser

    setup_logging("bench", "WARNING")
    if args.source is not None:
        from benchmarks.capacity.capacity import judge

        data = json.loads(args.source.read_text())
        extra = "\nMean prompt tokens per step:\n\n" + prompt_table(
            {
                m: {int(k): v for k, v in by.items()}
                for m, by in data["summary"]["prompt_tokens_by_step"].items()
            }
        )
        return judge(args.source, args.slo, Path(args.out), args.plot, NAME, extra)
    resolve(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes or args.agents < 1 or args.steps < 1:
        sys.stderr.write(
            f"--modes: some of {', '.join(MODES)} (not {bad}); --agents, --steps: 1+\n"
        )
        return 2
    rates = rates_of(args.qps)
    if rates is None:
        return 2
    model = ensure_preset(args.preset, args.model or DEFAULT_MODEL / "models" / args.preset)
    workload = AgentWorkload(
        agents=args.agents,
        steps=args.steps,
        system_tokens=args.system_tokens,
        task_tokens=args.task_tokens,
        tool_tokens=args.tool_tokens,
        max_tokens=args.max_tokens,
    )
    texts = AgentTexts(workload, _tokenizer(model), args.seed)
    dtype = pin_dtype(args)

    def driver(m: Any, served: str) -> AgentDriver:
        auth = {"authorization": f"Bearer {m.api_key}"} if m.api_key else {}
        return AgentDriver(m.name, m.url, served, texts, session=m.session, headers=auth)

    modes, rows, points = sweep_all(
        args, modes, model, texts, rates, args.warmup, asdict(workload), dtype.dtype, driver
    )
    summary = report.summary(rows, modes, points, args.slo)
    summary["prompt_tokens_by_step"] = prompt_tokens_by_step(points)
    meta = run_meta(
        NAME,
        model=str(model),
        preset=args.preset,
        modes=modes,
        workload=asdict(workload),
        qps=rates,
        requests=args.requests,
        warmup=args.warmup,
        slo_s=args.slo,
        dtype=dtype.dtype,
        kv_blocks=args.kv_blocks,
        max_model_len=args.max_model_len,
        cpu=cpu_info(),
        tool_call_parser=default_tool_parser(str(model)),
        threads=args.threads,
        vllm_args=args.vllm_arg,
        seed=args.seed,
        merged=[str(p) for p in args.merge],
        title=f"{args.agents} agents, {args.steps} steps x {args.tool_tokens}-token results",
    )
    data = {"meta": meta, "summary": summary, "results": rows, "requests": report.sent_rows(points)}
    text = report.headline(summary) + "\n" + report.table(rows) + "\n"
    text += "Mean prompt tokens per step:\n\n" + prompt_table(summary["prompt_tokens_by_step"])
    paths = write_outputs(Path(args.out), NAME, data, text)
    png = plot_path(args, NAME)
    title = f"{args.agents} agents, {args.steps} steps x {args.tool_tokens}-token results"
    report.plot(png, rows, modes, args.slo, f"{title}; {report.machine_label(meta)}")
    for path in [*paths, png]:
        sys.stdout.write(f"{path}\n")
    sys.stdout.write(report.headline(summary))
    return 0


def prompt_tokens_by_step(points: list[Point]) -> dict[str, dict[int, float]]:
    """Each mode's mean prompt tokens per step (answered requests, every rate): where a
    session's prompt parts from the whole conversation's."""
    sums: dict[str, dict[int, list[int]]] = {}
    for p in points:
        for s in p.sent:
            if s.error is None and s.prompt_tokens:
                sums.setdefault(p.mode, {}).setdefault(s.round, []).append(s.prompt_tokens)
    return {
        mode: {step: sum(v) / len(v) for step, v in sorted(steps.items())}
        for mode, steps in sums.items()
    }


def prompt_table(by_mode: dict[str, dict[int, float]]) -> str:
    from benchmarks.lib.util import markdown_table

    modes = list(by_mode)
    steps = sorted({step for v in by_mode.values() for step in v})
    rows = [[step, *(by_mode[m].get(step, float("nan")) for m in modes)] for step in steps]
    return markdown_table(["step", *modes], rows)


def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))
