"""`ctxcache bench reasoning`: a thinking model's conversations under each rule for past
reasoning (issue 58): context length, tokens recomputed and TTFT per step, and each answer
against the same engine's answer to the whole conversation sent without a session.

The workload: `--conversations` conversations of `--turns` user turns; each user turn is a
user message, then `--calls` requests answered by a tool call (`tool_choice: "required"`,
one call a request: `parallel_tool_calls: false`), each followed by the call's result of
`--tool-tokens` tokens, then a request answered in text (`tool_choice: "none"`). Every
assistant step thinks first (the thinking preset closes its `<think>` after a fixed number
of tokens). Three modes, side by side:

- `session-template`: a session created with the rule `template` (the default): when the
  next user message arrives, the closed turn's reasoning is dropped as the chat template
  drops it, and the stored history is re-based once;
- `session-keep`: a session created with `keep`: the exact generated tokens stay;
- `stateless`: a client without a session: the whole conversation, straight to vLLM,
  every step, as an OpenAI client sends it: the assistant messages of the open turn with
  their `reasoning`, those of closed turns without it.

All three run on one vLLM (with the ctxcache connector and the sidecar behind one gateway),
step by step in turn (the order rotating every step). The session modes have an API key of
a tenant each, so the gateway's per-tenant `cache_salt` keeps them from warming each other;
`stateless` sends no salt, so it shares no block with either. Every request streams; TTFT is
the time to the first event carrying reasoning, content or a tool-call delta.

Per step: `prompt_tokens` (the context), `cached_tokens`, recomputed = prompt - cached, the
TTFT, vLLM's own TTFT and the tokens the connector loaded (its /metrics, read around each
request). Each session step is then sent again, untimed, as its reference: that session's
own conversation so far, whole, to vLLM, as `stateless` sends one (its own `cache_salt`:
it warms nothing measured); the step's answer (content and tool calls), reasoning and
prompt length are compared with it. Greedy, and vLLM runs in float32 unless told
(`--dtype`), so equality is meaningful.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.agents.agents import cpu_info, vllm_dtype
from benchmarks.lib.util import add_output_arguments, plot_path, run_meta, write_outputs
from benchmarks.multiturn.multiturn import DEFAULT_MODEL, user_message

NAME = "reasoning"
MODES = ("session-template", "session-keep", "stateless")
REFERENCE = "stateless"
SYSTEM = (
    "You are a coding agent working on case {case:06d} in a Python repository. Think, "
    "use the tools to read files and run commands, then tell the user what you found."
)


@dataclass(frozen=True)
class Workload:
    """What every mode sends: the same conversations (`users[c][u]`: conversation c's
    message at user turn u; `results[c][u][k]`: the result of its k-th call)."""

    model: str
    calls: int  # forced tool calls per user turn; one more request answers in text
    users: list[list[str]]
    results: list[list[list[str]]]
    max_tokens: int

    @property
    def conversations(self) -> int:
        return len(self.users)

    @property
    def turns(self) -> int:
        return len(self.users[0])

    @property
    def steps(self) -> int:
        """Requests per user turn."""
        return self.calls + 1

    def system(self, conversation: int) -> str:
        return SYSTEM.format(case=conversation)

    def tool_choice(self, step: int) -> str:
        return "required" if step < self.calls else "none"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    p.add_argument("--calls", type=int, default=2, help="forced tool calls per user turn")
    p.add_argument("--tool-tokens", type=int, default=120, help="tokens of each tool result")
    p.add_argument("--user-tokens", type=int, default=40, help="tokens of each user message")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=192,
        help="max_tokens of every request (the thinking and the call or answer)",
    )
    p.add_argument("--preset", default="tiny-think", help="the thinking preset to build")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local model dir (default ~/.cache/ctxcache/models/PRESET, built if missing)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        help="vLLM's --dtype (float32: greedy answers compare token for token)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        help="vLLM's and the gateway's reasoning parser (default: `ctxcache vllm`'s choice "
        "for the model, and the gateway's default)",
    )
    p.add_argument("--kv-blocks", type=int, default=256, help="vLLM's KV cache in blocks")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads")
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="ARG", help="more vLLM arguments"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="1 conversation, 3 turns of 1 call, short results"
    )
    add_output_arguments(p, NAME)


def main(args: argparse.Namespace) -> int:
    from benchmarks.reasoning import reasoning_report as report
    from benchmarks.reasoning.reasoning_modes import run
    from benchmarks.reasoning.reasoning_stack import clients, start
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    if args.quick:
        args.conversations, args.turns, args.calls = 1, 3, 1
        args.tool_tokens, args.user_tokens = 40, 20
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES) or min(args.conversations, args.turns) < 1:
        sys.stderr.write(f"--modes: some of {', '.join(MODES)}; --conversations, --turns >= 1\n")
        return 2
    model = args.model or DEFAULT_MODEL / "models" / args.preset
    if not (model / "config.json").exists():
        from worker.presets import PRESETS, create_model

        if args.preset not in PRESETS:
            sys.stderr.write(f"no preset {args.preset!r} (presets: {', '.join(PRESETS)})\n")
            return 2
        sys.stderr.write(f"building the {args.preset} preset into {model} ...\n")
        create_model(args.preset, model)
    with start(args, model) as (stack, sup), clients(stack, modes) as per_mode:
        work = workload(args, model, per_mode[REFERENCE if REFERENCE in modes else modes[0]])
        records, errors = run(modes, work, per_mode, sup=sup, metrics=stack.metrics)
    rows = report.rows(records, modes, work)
    turns = report.turns(records, modes, work)
    meta = run_meta(
        NAME,
        modes=modes,
        references="each session step's conversation, sent whole to vLLM (untimed)",
        conversations=args.conversations,
        turns=args.turns,
        calls=args.calls,
        tool_tokens=args.tool_tokens,
        user_tokens=args.user_tokens,
        max_tokens=args.max_tokens,
        model=str(model),
        preset=args.preset,
        cpu=cpu_info(),
        vllm_dtype=vllm_dtype(Path(args.out) / "servers.log"),
        dtype_asked=args.dtype,
        reasoning_parser=stack.reasoning_parser,
        kv_blocks=args.kv_blocks,
        block_tokens=report.BLOCK,
        threads=args.threads,
        seed=args.seed,
        per_turn=turns,
        summary=report.summary(records, modes, work),
        errors=errors,
    )
    data = {"meta": meta, "results": rows}  # (every request: in its row's `requests`)
    table = report.table(meta, rows, turns, modes)
    paths = write_outputs(Path(args.out), NAME, data, table)
    png = plot_path(args, NAME)
    title = f"{args.preset}, {args.conversations} conversations x {args.turns} turns"
    report.plot(png, records, modes, work, f"{title} x {args.calls} calls")
    sys.stdout.write((Path(args.out) / f"{NAME}.md").read_text())
    for path in [*paths, png]:
        sys.stdout.write(f"{path}\n")
    for mode, error in errors.items():
        sys.stderr.write(f"{mode} failed: {error}\n")
    return 1 if errors else 0


def workload(args: argparse.Namespace, model: Path, engine: Any) -> Workload:
    """The conversations' messages and tool results (seeded), and the served model's id
    (`engine`: an httpx client of vLLM or the gateway)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(args.seed)
    users = [
        [user_message(rng, args.user_tokens, tokenizer) for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    results = [
        [
            [user_message(rng, args.tool_tokens, tokenizer) for _ in range(args.calls)]
            for _ in range(args.turns)
        ]
        for _ in range(args.conversations)
    ]
    served = engine.get("/v1/models").json()["data"][0]["id"]
    return Workload(str(served), args.calls, users, results, args.max_tokens)
