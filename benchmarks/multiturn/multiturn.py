"""`ctxcache bench multiturn`: multi-turn chats replayed with a session and without.

The workload is synthetic and deterministic, shaped like the public ShareGPT multi-turn
replays: N conversations of up to 8 turns whose prompts average about 54, 206, 371, 532,
690, 826, 964 and 1,114 tokens at turns 1-8 (about 150 new tokens a turn: a user message
plus the previous answer). Each conversation starts with a short system message; the
assistant turns are whatever the model answers (greedy, `--max-tokens` at most).

`--engine vllm` (the default where vLLM is installed) compares, on the same vLLM settings
(`multiturn_stacks.py` starts one vLLM per mode):
- `vllm-full`: vLLM alone, the whole history every turn — what users have today;
- `session`: the ctxcache gateway, only the new turn with `session_id`, vLLM storing and
  loading the session's KV through the sidecar (the ctxcache connector);
- `session-no-sidecar`: the same without the connector: what the gateway alone buys;
- `roomy`: vLLM alone with a KV cache that holds every conversation: the floor a cache
  tier cannot beat;
- `stateless-gateway` (opt-in): the `session` stack (gateway, vLLM with the connector,
  sidecar) sent the whole history every turn without `session_id`, as most OpenAI clients
  do: what the gateway's implicit sessions give them (issue 55); its own tenant, so it
  reuses nothing of the `session` mode's.
`--kv-blocks` sizes the KV cache of the first three; with `--interleave` (turn t of every
conversation before turn t+1 of any: many users, each thinking between turns) and more
conversations than the cache holds, vLLM's own prefix cache loses each conversation
before its next turn.

`--engine builtin` compares `session`, `full` (the whole history, nothing reused),
`full-apc` (the whole history, the worker's own prefix cache), optionally
`stateless-gateway` (the whole history, no salt of the client's, a tenant of its own) and
the in-process `floor`.

Modes are interleaved turn by turn in one run. Every request streams; TTFT is the time to
the first chunk carrying text. Per turn: TTFT p50/p90, total latency, request bytes,
`cached_tokens`, and whether each mode's greedy answer is identical to the reference mode's
(`vllm-full`, or `full`), with the token where a difference starts.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from benchmarks.lib.util import (
    add_output_arguments,
    ensure_preset,
    plot_path,
    run_meta,
    write_outputs,
)
from benchmarks.multiturn.multiturn_stacks import (
    BUILTIN_MODES,
    BUILTIN_SALTS,
    STATELESS,
    VLLM_DEFAULT_MODES,
    VLLM_MODES,
    Mode,
    idle_cpu,
)

NAME = "multiturn"
# average prompt tokens at turns 1-8 of the ShareGPT multi-turn replays
TARGET_CONTEXT = (54, 206, 371, 532, 690, 826, 964, 1114)
TEMPLATE_TOKENS = 5  # what ChatML adds around a user message (measured when a model is at hand)
_WORD_TEXT = (
    "the a of to and in is it that for on with as was be by this are or from at an "
    "have not but which you they we one all can there their what so if about when more "
    "time will would up out some other into has two than them could like then its only "
    "session server model token cache history turn answer question data system user "
    "request memory block store build run test code file list value result number "
    "python function class return string error write read start stop first last next"
)
WORDS = _WORD_TEXT.split()
# vLLM's shm_broadcast readers busy-loop for busy_loop_s = 1 s after each read before they
# park on a socket; another engine asked within that second shares the CPUs with the spin
VLLM_SWITCH_GAP_S = 1.2
DEFAULT_MODEL = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ctxcache"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ctxcache.vllm_engine import default_engine

    p.add_argument(
        "--engine",
        choices=("vllm", "builtin"),
        default=default_engine(),
        help="vllm (where installed) or the built-in worker",
    )
    p.add_argument("--url", help="replay against this OpenAI-compatible URL (builtin modes)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer key")
    p.add_argument(
        "--stateless-api-key",
        help="with --url: stateless-gateway's bearer key, of another tenant than --api-key's "
        "(default --api-key's: then it may reuse the session mode's KV)",
    )
    p.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL / "models" / "small",
        help="local model dir (the small preset is built there if missing)",
    )
    p.add_argument("--model-name", help="the model id in the API (default: the first listed)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=8, choices=range(1, len(TARGET_CONTEXT) + 1))
    p.add_argument(
        "--max-tokens",
        "--answer-tokens",
        dest="answer_tokens",
        type=int,
        default=100,
        help="max_tokens of each answer",
    )
    p.add_argument(
        "--modes",
        default=None,
        help=f"comma-separated; vllm: {', '.join(VLLM_MODES)} (default the first four); "
        f"builtin: {', '.join(BUILTIN_MODES)} (default session,full); stateless-gateway: "
        "the whole history through the gateway without session_id, on the session's stack "
        "(a tenant of its own)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="turn t of every conversation before turn t+1 of any (default: one "
        "conversation after another)",
    )
    p.add_argument(
        "--think-time",
        type=float,
        default=0.0,
        help="seconds between one answer and the next request (a user reading)",
    )
    p.add_argument(
        "--switch-gap",
        type=float,
        default=None,
        help="seconds an engine idles before the next mode's engine is asked (default "
        f"{VLLM_SWITCH_GAP_S} with --engine vllm, else 0): vLLM's workers spin on their "
        "shared-memory queue for 1 s after each message, and on few CPUs that spin slows "
        "the next engine",
    )
    p.add_argument("--kv-blocks", type=int, default=48, help="vLLM's KV cache in blocks")
    p.add_argument("--roomy-gib", type=int, default=2, help="the roomy vLLM's KV cache, GiB")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="vLLM's window (capped at what --kv-blocks holds)",
    )
    p.add_argument(
        "--vllm-arg", action="append", default=[], metavar="ARG", help="more vLLM arguments"
    )
    p.add_argument("--no-floor", action="store_true", help="builtin: skip the in-process floor")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="2 conversations, 3 turns, 8-token answers")
    add_output_arguments(p, NAME)


def main(args: argparse.Namespace) -> int:
    from benchmarks.multiturn import multiturn_report as report
    from benchmarks.multiturn.multiturn_replay import Replay
    from benchmarks.multiturn.multiturn_stacks import start
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    if args.quick:
        args.conversations, args.turns, args.answer_tokens = 2, 3, 8
    if args.switch_gap is None:
        args.switch_gap = VLLM_SWITCH_GAP_S if args.engine == "vllm" and not args.url else 0.0
    known = VLLM_MODES if args.engine == "vllm" and not args.url else BUILTIN_MODES
    default = ",".join(VLLM_DEFAULT_MODES) if known is VLLM_MODES else "session,full"
    modes = [m.strip() for m in (args.modes or default).split(",") if m.strip()]
    bad = [m for m in modes if m not in known]
    if bad or not modes:
        sys.stderr.write(f"unknown mode(s) {bad}; choose from {', '.join(known)}\n")
        return 2
    local = args.model if (args.model / "config.json").exists() or not args.url else None
    if local is not None:
        ensure_preset("small", local)
    floor = None
    if known is BUILTIN_MODES and local is not None and not args.no_floor:
        from benchmarks.multiturn.floor import Floor

        floor = Floor(local, args.threads)
    idle: dict[str, float] | None = None
    if args.url:
        url = args.url.rstrip("/")
        keys = {m: args.stateless_api_key if m == STATELESS else None for m in modes}
        given = [Mode(m, url, m == "session", BUILTIN_SALTS[m], api_key=keys[m]) for m in modes]
        servers: Any = nullcontext((given, None))
    else:
        assert local is not None
        servers = start(args, modes, local)
    with servers as (stack, sup):
        if sup is not None:  # the modes' servers are all up: what do the idle ones cost?
            idle = idle_cpu(sup)
            sys.stderr.write(f"idle servers, % of one CPU over 5 s: {idle}\n")
        replay = Replay(args, stack, floor, _tokenizer(local))
        replay.run(sup.stopping if sup is not None else threading.Event())
    rows = replay.rows()
    names = [m.name for m in stack] + (["floor"] if floor else [])
    meta = run_meta(
        NAME,
        engine=args.engine,
        url=args.url or f"started by the benchmark ({args.engine})",
        model=str(local or args.model_name),
        conversations=args.conversations,
        turns=args.turns,
        answer_tokens=args.answer_tokens,
        modes=names,
        reference=replay.reference,
        interleave=args.interleave,
        think_time_s=args.think_time,
        switch_gap_s=args.switch_gap,
        kv_blocks=args.kv_blocks if args.engine == "vllm" else None,
        idle_cpu_percent=idle,
        threads=args.threads,
        seed=args.seed,
    )
    summary = report.summary(rows, names, replay)
    data = {"meta": meta, "summary": summary, "results": rows, "requests": replay.log}
    paths = write_outputs(Path(args.out), NAME, data, report.table(rows, names, replay.reference))
    png = plot_path(args, NAME)
    report.plot(png, rows, names, f"{args.engine}, {args.conversations} conversations")
    for path in [*paths, png]:
        sys.stdout.write(f"{path}\n")
    for key, value in summary.items():
        sys.stdout.write(f"{key}: {value}\n")
    return 0


# -- the workload ---------------------------------------------------------------------------
def user_token_targets(turns: int, answer_tokens: int) -> list[int]:
    """New user tokens per turn so that prompts follow TARGET_CONTEXT when answers are
    `answer_tokens` long (turn 1 also carries the system message, about 12 tokens)."""
    out = [TARGET_CONTEXT[0] - 12 - 2 * TEMPLATE_TOKENS]
    for k in range(1, turns):
        grow = TARGET_CONTEXT[k] - TARGET_CONTEXT[k - 1]
        out.append(max(8, grow - answer_tokens - 2 * TEMPLATE_TOKENS))
    return out


def user_message(rng: random.Random, tokens: int, tokenizer: Any | None) -> str:
    """A deterministic user message of about `tokens` tokens."""
    if tokenizer is None:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens * 0.75))))
    words: list[str] = []
    while True:
        words.append(rng.choice(WORDS))
        if len(tokenizer.encode(" ".join(words), add_special_tokens=False)) >= tokens:
            return " ".join(words)


def _tokenizer(model: Path | None) -> Any | None:
    if model is None or not (model / "tokenizer.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))
