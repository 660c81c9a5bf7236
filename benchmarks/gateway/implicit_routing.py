"""`ctxcache bench implicit-routing`: shared prefixes and routing of clients that never send
`session_id`, with two workers (issue 55, docs/implicit.md).

The workload: `--conversations` new conversations of one tenant, without `session_id`,
that share one long system prompt (`--system-tokens`) and each ask a different first
question, then `--turns` - 1 more questions, the whole conversation resent every request
(as the OpenAI SDKs' clients do), conversation after conversation. Which worker served
each request is read from the workers' own counters (the one whose prompt tokens moved),
with the tokens it reused by tier (its L1, the sidecar). Every request streams; TTFT is
the time to the first chunk carrying text.

The ways (`--ways`) run on two stacks, each of Redis, a sidecar, two built-in workers `w0`
and `w1` on the same model and a gateway: implicit sessions on (`implicit` and `keyed`, a
tenant each: they share no state and no KV) and off (`passthrough`). Both stacks are up
before the first request, and the ways are measured side by side: one request at a time,
the ways in turn request by request (their order rotating every step), so one engine
computes at a time and the machine's load weighs on every way alike.

- `implicit`: the gateway's default. The first conversation is a miss (the least-loaded
  worker); each later one forks its system prompt (`shared`: its prefix the first's
  stored ids, its KV the first's blocks) on the worker that holds it, and its later turns
  are `hit`s on its own session's worker. The workers store KV into the sidecar.
- `passthrough`: `CTX_GATEWAY_IMPLICIT_SESSIONS=false`, every request passed through to
  the least-loaded worker (round robin when both are idle), as vLLM behind a plain load
  balancer: reuse only where that worker's own prefix cache (the L1) has the prefix. The
  workers store nothing into the sidecar, as vLLM's connector stores nothing untagged.
- `keyed`: `implicit`, but `--users` users of two conversations each, every request with
  `prompt_cache_key` = its user: a new conversation goes to the worker its key hashes to
  (rendezvous hashing), so every request of a key lands on one worker, and a user's second
  conversation forks the first's system prompt (a key's states are its own: the match key
  holds it).

After `implicit`'s conversations, the load bound (`--load-check`): `imbalance_slack` + 1
long streams keep the system prompt's worker busy (each a new conversation whose
`prompt_cache_key` hashes to it), then `--probes` new conversations with the shared system
prompt arrive: the affine worker runs more than `CTX_GATEWAY_IMBALANCE_SLACK` requests
above the other, so they go to the other worker, which reads the prefix's blocks from the
sidecar (the first conversation's KV tag). Once the streams are cancelled, one more new
conversation goes back to the prefix's worker.

Outputs: `implicit-routing.json` (every request in `meta.requests`), `.md` (the tables),
`.png` (TTFT p50 of first requests and of later turns, per way).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.gateway.implicit_routing_client import Busy, Client, Conversation, Served
from benchmarks.lib.util import (
    add_output_arguments,
    ensure_preset,
    plot_path,
    run_meta,
    write_outputs,
)

NAME = "implicit-routing"
WAYS = ("implicit", "passthrough", "keyed")
WORKERS = ("w0", "w1")
SYSTEM = "You are the support assistant of the ctxcache project. Read the handbook first. "


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.multiturn.multiturn import DEFAULT_MODEL

    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated: {', '.join(WAYS)}")
    p.add_argument("--conversations", type=int, default=8, help="new conversations a way")
    p.add_argument("--turns", type=int, default=3, help="requests a conversation")
    p.add_argument("--system-tokens", type=int, default=1500, help="the shared system prompt")
    p.add_argument("--question-tokens", type=int, default=24, help="each user message")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every request")
    p.add_argument("--users", type=int, default=4, help="keyed: users of two conversations")
    p.add_argument(
        "--load-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="implicit: new conversations while the prefix's worker is busy",
    )
    p.add_argument("--probes", type=int, default=3, help="load check: new conversations")
    p.add_argument(
        "--imbalance-slack", type=int, default=4, help="the gateways' CTX_GATEWAY_IMBALANCE_SLACK"
    )
    p.add_argument("--busy-tokens", type=int, default=2000, help="load check: each stream's")
    p.add_argument(
        "--threads", type=int, default=0, help="each worker's torch threads (0: torch's)"
    )
    p.add_argument("--preset", choices=("tiny", "small"), default="small")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help=f"local model dir (default {DEFAULT_MODEL}/models/PRESET, built if missing)",
    )
    p.add_argument("--seed", type=int, default=55)
    p.add_argument("--quick", action="store_true", help="3 conversations, 2 turns, 2 users")
    p.add_argument("--no-progress", action="store_true")
    add_output_arguments(p, NAME)


@dataclass(frozen=True)
class Record:
    """One request, as the table reads it."""

    way: str
    phase: str  # "main"; the load check's "busy" (the prefix's worker busy) and "after"
    conversation: str
    turn: int
    key: str | None
    worker: str
    first_worker: str  # the worker of its conversation's first request
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    cached_tokens: int
    l1_tokens: int
    sidecar_tokens: int
    result: str  # the gateway's implicit result (`ctxcache_gateway_implicit_total`)
    inflight: dict[str, int] | None = None  # the gateway's, per worker, before it was sent


def main(args: argparse.Namespace) -> int:
    from benchmarks.gateway import implicit_routing_report as report
    from benchmarks.multiturn.multiturn import DEFAULT_MODEL
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    if args.quick:
        args.conversations, args.turns, args.users, args.probes = 3, 2, 2, 2
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    if not ways or set(ways) - set(WAYS) or args.conversations < 2 or args.turns < 1:
        sys.stderr.write(f"--ways: some of {', '.join(WAYS)}; --conversations: 2 or more\n")
        return 2
    model = args.model or DEFAULT_MODEL / "models" / args.preset
    ensure_preset(args.preset, model)
    work = Workload.make(args, model)
    meta = run_meta(NAME)  # (its date and load average: the start's)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as owner:
        urls = start_stacks(args, ways, model, out, owner)
        records, counts = asyncio.run(run_ways(args, ways, work, urls))
    rows = report.rows(records, work.prefix_tokens)
    meta.update(
        ways=ways,
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        prefix_tokens=work.prefix_tokens,
        question_tokens=args.question_tokens,
        max_tokens=args.max_tokens,
        users=args.users,
        load_check=args.load_check,
        probes=args.probes,
        imbalance_slack=args.imbalance_slack,
        model=str(model),
        threads=args.threads,
        seed=args.seed,
        gateway_implicit_counts=counts,  # per stack: implicit sessions on, off
        requests=[asdict(r) for r in records],
        load_avg_1m_end=round(os.getloadavg()[0], 2),
    )
    data = {"meta": meta, "results": rows}
    paths = write_outputs(out, NAME, data, report.table(meta, rows))
    png = plot_path(args, NAME)
    report.plot(png, rows, f"{model.name}, {work.prefix_tokens}-token shared system prompt")
    sys.stdout.write((out / f"{NAME}.md").read_text())
    for path in [*paths, png]:
        sys.stdout.write(f"{path}\n")
    return 0


@dataclass(frozen=True)
class Workload:
    """The system prompt every conversation shares and each conversation's questions."""

    system: str
    questions: list[list[str]]  # per conversation (keyed: per user and conversation)
    model: str  # the served name
    prefix_tokens: int  # the system prompt rendered alone (what a fork can reuse)

    @classmethod
    def make(cls, args: argparse.Namespace, model: Path) -> Workload:
        from transformers import AutoTokenizer

        from benchmarks.multiturn.multiturn import user_message

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        rng = random.Random(args.seed)
        system = SYSTEM + user_message(rng, args.system_tokens, tokenizer)
        n = max(args.conversations, 2 * args.users) + args.probes + 1
        questions = [
            [user_message(rng, args.question_tokens, tokenizer) + "?" for _ in range(args.turns)]
            for _ in range(n)
        ]
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}], tokenize=False, add_generation_prompt=False
        )
        rendered = tokenizer.encode(text, add_special_tokens=False)
        return cls(system, questions, model.name, len(rendered))


def kind_of(way: str) -> str:
    """The stack a way runs on: implicit sessions on (`implicit` and `keyed`, a tenant
    each) or off (`passthrough`)."""
    return "off" if way == "passthrough" else "on"


def api_key(way: str) -> str:
    """The way's API key, its tenant's name too: the ways on one stack share no state and
    no KV (the gateway salts every request per tenant)."""
    return f"bench-{way}"


def start_stacks(
    args: argparse.Namespace, ways: list[str], model: Path, out: Path, owner: ExitStack
) -> dict[str, tuple[str, dict[str, str]]]:
    """A stack per kind of the ways (Redis, a sidecar, the two workers, storing into the
    sidecar where implicit sessions are on, and the gateway), stopped with `owner`: every
    engine started at once, then each gateway once its engines are up. Per way: its
    gateway's URL and its workers' by the gateway's names."""
    from benchmarks.lib.stack import Engine, Gateway, StackBuilder, StackSettings, SupervisorRunner
    from ctxcache.supervisor import Supervisor

    threads = ("--threads", str(args.threads)) if args.threads else ()
    builders = {}
    for kind in dict.fromkeys(map(kind_of, ways)):
        engines = tuple(
            Engine("builtin", w, threads, model, kind == "on", False, w, startup_timeout=600)
            for w in WORKERS
        )
        settings = StackSettings(
            redis_appendonly=False,
            sidecar=("--memory-bytes", str(1 << 30), "--log-level", "WARNING"),
            engines=engines,
        )
        tmp = owner.enter_context(tempfile.TemporaryDirectory(prefix="ctxcache-bench-routing-"))
        logs = owner.enter_context((out / f"stack-{kind}.log").open("w"))
        sup = owner.enter_context(Supervisor(out=logs))
        builders[kind] = StackBuilder(settings, Path(tmp), SupervisorRunner(sup))
        owner.callback(builders[kind].stop)
        builders[kind].start()
    urls = {}
    for kind, builder in builders.items():
        builder.wait_engines(timeout=600)
        here = [w for w in ways if kind_of(w) == kind]
        env = {
            "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5",
            "CTX_GATEWAY_IMBALANCE_SLACK": str(args.imbalance_slack),
            "CTX_GATEWAY_IMPLICIT_SESSIONS": "true" if kind == "on" else "false",
        }
        gateway = builder.gateway(Gateway(keys={api_key(w): api_key(w) for w in here}, env=env))
        workers = {w: builder.stack.url(w) for w in WORKERS}
        urls.update({w: (gateway.url, workers) for w in here})
    return urls


def keyed_to(key_prefix: str, worker: str) -> str:
    """A `prompt_cache_key` that hashes to `worker` (rendezvous hashing over both, as
    `gateway.pool.WorkerPool.keyed` does)."""
    for i in range(1000):
        key = f"{key_prefix}-{i}"
        if max(WORKERS, key=lambda w: hashlib.blake2b(f"{w}\0{key}".encode()).digest()) == worker:
            return key
    raise AssertionError("no key hashes there")


async def run_ways(
    args: argparse.Namespace,
    ways: list[str],
    work: Workload,
    urls: dict[str, tuple[str, dict[str, str]]],
) -> tuple[list[Record], dict[str, dict[str, int]]]:
    """The ways' conversations, request by request in turn (the ways' order rotating every
    step), then `implicit`'s load check: every request's record, and each stack's gateway's
    implicit counts over the run (the load check's busy streams are misses there)."""
    from tqdm import tqdm

    clients = {
        way: Client(gw, api_key(way), work.model, workers) for way, (gw, workers) in urls.items()
    }
    try:
        for client in clients.values():
            await client.wait_workers(list(WORKERS))
            await client.warm_up()
        gateways = {kind_of(way): client for way, client in clients.items()}  # (one a stack)
        before = {kind: await client.implicit() for kind, client in gateways.items()}
        plans = {way: conversations(args, way, work) for way in ways}
        steps = [(i, t) for i in range(max(map(len, plans.values()))) for t in range(args.turns)]
        check = "implicit" in ways and args.load_check
        total = sum(map(len, plans.values())) * args.turns + (args.probes + 1 if check else 0)
        records: list[Record] = []
        firsts: dict[tuple[str, str], str] = {}  # (way, conversation) -> its first worker
        with tqdm(total=total, desc="requests", unit="req", disable=args.no_progress) as bar:
            for k, (i, turn) in enumerate(steps):
                for way in ways[k % len(ways) :] + ways[: k % len(ways)]:
                    if i >= len(plans[way]):
                        continue
                    conv = plans[way][i]
                    served = await clients[way].send(conv, turn, args.max_tokens)
                    first = firsts.setdefault((way, conv.name), served.worker)
                    records.append(record(way, "main", conv, turn, served, first))
                    bar.update(1)
            if check:  # the system prompt's worker: the first conversation's
                owner = next(r.worker for r in records if r.way == "implicit")
                records += await load_check(args, work, clients["implicit"], owner, bar)
        counts = {}
        for kind, client in gateways.items():
            after = await client.implicit()
            counts[kind] = {k: after[k] - before[kind][k] for k in after}
        return records, counts
    finally:
        for client in clients.values():
            await client.aclose()


def conversations(args: argparse.Namespace, way: str, work: Workload) -> list[Conversation]:
    if way != "keyed":
        return [
            Conversation(f"c{i}", work.system, work.questions[i]) for i in range(args.conversations)
        ]
    return [  # each user's first conversation, then each one's second
        Conversation(f"u{u}-c{c}", work.system, work.questions[c * args.users + u], f"user-{u}")
        for c in range(2)
        for u in range(args.users)
    ]


async def load_check(
    args: argparse.Namespace, work: Workload, client: Client, owner: str, bar: Any
) -> list[Record]:
    """`imbalance_slack` + 1 streams busy on `owner`, then `--probes` new conversations
    with the shared system prompt; then the streams cancelled and one more."""
    busy = Busy(client, keyed_to("busy", owner), args.imbalance_slack + 1, args.busy_tokens)
    out: list[Record] = []
    base = args.conversations
    await busy.start()
    try:
        for i in range(args.probes):
            conv = Conversation(f"p{i}", work.system, work.questions[base + i])
            inflight = await client.inflight()
            served = await client.send(conv, 0, args.max_tokens)
            out.append(record("implicit", "busy", conv, 0, served, served.worker, inflight))
            bar.update(1)
    finally:
        running = await busy.stop()
    if not all(running):
        raise RuntimeError("a busy stream ended before the probes did: raise --busy-tokens")
    for _ in range(50):  # the gateway's leases of the cancelled streams, given back
        inflight = await client.inflight()
        if not any(inflight.values()):
            break
        await asyncio.sleep(0.1)
    conv = Conversation("after", work.system, work.questions[base + args.probes])
    served = await client.send(conv, 0, args.max_tokens)
    out.append(record("implicit", "after", conv, 0, served, served.worker, inflight))
    bar.update(1)
    return out


def record(
    way: str,
    phase: str,
    conv: Conversation,
    turn: int,
    served: Served,
    first: str,
    inflight: dict[str, int] | None = None,
) -> Record:
    return Record(
        way=way,
        phase=phase,
        conversation=conv.name,
        turn=turn,
        key=conv.key,
        worker=served.worker,
        first_worker=first,
        ttft_ms=round(served.ttft_s * 1e3, 2),
        total_ms=round(served.total_s * 1e3, 2),
        prompt_tokens=served.prompt_tokens,
        cached_tokens=served.cached_tokens,
        l1_tokens=served.tiers.get("l1", 0),
        sidecar_tokens=served.tiers.get("sidecar", 0),
        result=served.result,
        inflight=inflight,
    )
