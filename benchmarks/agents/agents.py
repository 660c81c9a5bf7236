"""`ctxcache bench agents`: an agent's tool loop, four ways side by side on one vLLM.

One agent loop: a system prompt and two function tools, a user message, then `--steps`
requests whose answer is a tool call (a named `tool_choice`, so even a random-weight preset
answers with a valid call: vLLM's structured outputs), each followed by the call's result of
`--tool-tokens` tokens of filler text, and a last request (`tool_choice: "none"`) that reads
the last result and answers in text. The same loop, four ways (`--ways`):

- `session`: `POST /v1/context` with the system prompt and the tools (timed, counted in the
  loop's total), then each step `POST /v1/chat/completions` through the gateway with
  `session_id` and only the new messages (the user message; then the `tool` message
  answering the call returned);
- `stateless`: vLLM at its best without ctxcache: the whole conversation every step (the
  assistant's tool-call messages included) straight to vLLM's `/v1/chat/completions`, its
  own prefix cache on (vLLM's default);
- `responses`: `POST /v1/responses` through the gateway: function tools, `instructions`
  every step (as the Agents SDK sends them), `previous_response_id` and only the new
  `function_call_output` item;
- `stateless-gateway`: what `stateless` sends, through the gateway, without `session_id`:
  an agent framework pointed at ctxcache unchanged (LangGraph, the Agents SDK over chat
  completions), served by the gateway's implicit sessions (issue 55; before them, passed
  through to vLLM).

Every request streams and sends the tools and its `tool_choice`, as agent frameworks do.
TTFT is the time to the first event carrying content or a tool-call delta (Responses: the
first `response.output_item.added` or `*.delta` event); `cached_tokens` comes from each
answer's usage. The ways run step by step in turn (step k of each before step k+1 of any,
the order rotating every step), for `--rounds` rounds after `--warmup` uncounted ones; every
loop has its own task number in its system prompt, so no loop reuses another's prefix (nor
is any loop's conversation another's: the ways through the gateway share its one tenant).

One stack: Redis, the sidecar, vLLM with the ctxcache connector and a tool parser (as `bench
multiturn` starts its `session` mode: `multiturn_stacks.start`) and the gateway; the
stateless way calls that same vLLM directly.

`--capacity` (`agents_capacity.py`, `agents_load.py`): many agents at once at offered
rates, one engine at a time, with `bench capacity`'s driver, sweep and report: the highest
rate each mode (`--modes`) holds at p95 TTFT ≤ `--slo`, the answers compared with
vllm-full-connector's per agent and step.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.lib.util import (
    add_output_arguments,
    ensure_preset,
    plot_path,
    run_meta,
    write_outputs,
)
from benchmarks.multiturn.multiturn import DEFAULT_MODEL, user_message
from ctxcache.cpu import AMX_FLAGS, cpu_class, cpu_flags

NAME = "agents"
WAYS = ("session", "stateless", "responses", "stateless-gateway")
SYSTEM = (
    "You are a coding agent working on task {task:06d} in a Python repository. Use the "
    "tools to read files and run commands until the failing test passes, then say what "
    "you changed."
)
USER = "The test suite fails in tests/test_parser.py. Find out why and fix it."
_STRING = {"type": "string", "maxLength": 16}  # bounds a random-weight model's arguments
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {arg: _STRING},
                "required": [arg],
                "additionalProperties": False,
            },
            "strict": True,  # vLLM holds the arguments to the schema only when strict
        },
    }
    for name, description, arg in (
        ("read_file", "Read a file of the repository", "path"),
        ("run_command", "Run a shell command in the repository", "command"),
    )
]


@dataclass(frozen=True)
class Workload:
    """What every way sends: the same loop, only its task number differs."""

    model: str
    steps: int  # requests answered by a tool call; one more answers in text
    results: list[str]  # the result of each step's call, `--tool-tokens` tokens each
    max_tokens: int

    def system(self, task: int) -> str:
        return SYSTEM.format(task=task)

    def tool_choice(self, k: int) -> Any:
        return tool_choice(k, self.steps)

    @property
    def requests(self) -> int:
        return self.steps + 1


def tool_choice(k: int, steps: int) -> Any:
    """Request k's choice (from 0): a named tool, alternating; `none` for the answer."""
    if k >= steps:
        return "none"
    return {"type": "function", "function": {"name": TOOLS[k % 2]["function"]["name"]}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.agents.agents_capacity import CAPACITY, add_capacity_arguments

    def default(name: str) -> str:
        return f"({LOOP[name]}; --capacity: {CAPACITY[name]})"

    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated: {', '.join(WAYS)}")
    # (None: LOOP's default here, agents_capacity.CAPACITY's with --capacity)
    p.add_argument(
        "--steps", type=int, default=None, help=f"tool calls in a loop {default('steps')}"
    )
    p.add_argument(
        "--tool-tokens",
        type=int,
        default=None,
        help=f"tokens of each tool result {default('tool_tokens')}",
    )
    p.add_argument("--rounds", type=int, default=3, help="loops of each way measured")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="rounds run first, not counted (1; with --capacity: requests sent before "
        "measuring, default --agents x (--steps + 1))",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=128,
        help="max_tokens of every request (a forced call on the tiny preset takes ~75)",
    )
    p.add_argument("--preset", choices=("tiny", "small"), default="small")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local model dir (default ~/.cache/ctxcache/models/PRESET, built if missing)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="vLLM's --dtype (auto: vLLM's choice; with --capacity, by the CPU as `bench "
        "capacity` chooses: bfloat16 with AMX or avx512_bf16, else float32)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help=f"vLLM's KV cache in blocks {default('kv_blocks')}",
    )
    p.add_argument("--max-model-len", type=int, default=None, help=default("max_model_len"))
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads")
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="ARG", help="more vLLM arguments"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="3 steps, 40-token results, 1 round (with --capacity: agents_capacity.QUICK)",
    )
    add_output_arguments(p, NAME)
    add_capacity_arguments(p)


# the loop's defaults of the options `--capacity` gives others (agents_capacity.CAPACITY)
LOOP: dict[str, Any] = {
    "steps": 8,
    "tool_tokens": 200,
    "warmup": 1,
    "kv_blocks": 256,
    "max_model_len": 4096,
}


def resolve_loop(args: argparse.Namespace) -> None:
    """LOOP for every option not given; `--quick`'s sizes."""
    for name, value in LOOP.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick:
        args.steps, args.tool_tokens, args.rounds, args.warmup = 3, 40, 1, 0


def main(args: argparse.Namespace) -> int:
    import httpx

    from benchmarks.agents import agents_report as report
    from benchmarks.agents.agents_ways import run
    from benchmarks.kvpath.kvpath_vllm import scrape
    from benchmarks.multiturn.multiturn_stacks import start
    from ctxcache.logs import setup_logging

    if args.capacity:
        from benchmarks.agents import agents_capacity

        return agents_capacity.main(args)
    setup_logging("bench", "WARNING")
    resolve_loop(args)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or set(ways) - set(WAYS) or args.steps < 1 or args.rounds < 1:
        sys.stderr.write(f"--ways: some of {', '.join(WAYS)}; --steps, --rounds: 1 or more\n")
        return 2
    model = args.model or DEFAULT_MODEL / "models" / args.preset
    ensure_preset(args.preset, model)
    # what multiturn_stacks.start reads: its `session` mode, one vLLM behind the gateway
    args.engine = "vllm"
    if args.dtype != "auto":
        args.vllm_arg = [f"--dtype={args.dtype}", *args.vllm_arg]
    with start(args, ["session"], model, log_name="servers.log") as (stack, sup):
        (mode,) = stack
        work = workload(args, model, mode.engine)
        with httpx.Client(base_url=mode.engine, timeout=30) as vllm:
            records, errors = run(
                args,
                ways,
                work,
                gateway=mode.url,
                engine=mode.engine,
                sup=sup,
                metrics=lambda: scrape(vllm),
            )
    rows = report.rows(records, ways, work.requests)
    meta = run_meta(
        NAME,
        ways=ways,
        steps=args.steps,
        tool_tokens=args.tool_tokens,
        rounds=args.rounds,
        warmup=args.warmup,
        max_tokens=args.max_tokens,
        model=str(model),
        preset=args.preset,
        cpu=cpu_info(),
        vllm_dtype=vllm_dtype(Path(args.out) / "servers.log"),
        dtype_asked=args.dtype,
        tool_call_parser=_tool_parser(model),
        kv_blocks=args.kv_blocks,
        threads=args.threads,
        seed=args.seed,
        totals=report.totals(records, ways),
        errors=errors,
    )
    data = {"meta": meta, "results": rows}  # (every request: in its row's `rounds`)
    paths = write_outputs(Path(args.out), NAME, data, report.table(meta, rows, ways))
    png = plot_path(args, NAME)
    report.plot(png, rows, ways, f"{args.preset}, {args.steps} steps x {args.tool_tokens} tokens")
    sys.stdout.write((Path(args.out) / f"{NAME}.md").read_text())
    for path in [*paths, png]:
        sys.stdout.write(f"{path}\n")
    for way, error in errors.items():
        sys.stderr.write(f"{way} failed: {error}\n")
    return 1 if errors else 0


def workload(args: argparse.Namespace, model: Path, engine: str) -> Workload:
    import httpx
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(args.seed)
    results = [user_message(rng, args.tool_tokens, tokenizer) for _ in range(args.steps)]
    served = httpx.get(f"{engine}/v1/models", timeout=30).json()["data"][0]["id"]
    return Workload(str(served), args.steps, results, args.max_tokens)


def cpu_info() -> dict[str, Any]:
    """The CPU's model, its class and whether it has AMX or AVX512-BF16 (what bf16 runs
    on), from `ctxcache.cpu`'s reading of the flags."""
    flags = cpu_flags()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return {
        "model": model.group(1).strip() if model else None,
        "class": cpu_class(flags),
        "amx": bool(AMX_FLAGS & flags),
        "avx512_bf16": "avx512_bf16" in flags,
    }


def vllm_dtype(log: Path) -> str | None:
    """The dtype vLLM ran the model in, from its start-up line (`dtype=torch.bfloat16`)."""
    try:
        found = re.search(r"dtype=torch\.(\w+)", log.read_text(errors="replace"))
    except OSError:
        return None
    return found.group(1) if found else None


def _tool_parser(model: Path) -> str | None:
    from ctxcache.vllm_engine import default_tool_parser

    return default_tool_parser(str(model))  # what `ctxcache vllm` picked (its default)
