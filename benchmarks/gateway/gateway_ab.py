"""`ctxcache bench gateway-ab`: two checkouts' gateways, side by side, on one machine.

`bench gateway` measures one gateway against calling the worker directly. On a small VM
its numbers move from one run to the next by more than the changes it is asked to judge:
the same commit's streaming TTFT ratio came out 2.28×, 2.53× and 2.36× in three runs, its
session turns at 1.52, 1.73 and 1.55 ms (docs/benchmarks.md, "Fifth pass"). This bench
answers "is B faster than A?" instead: two gateways (each started from its own checkout,
`--a` and `--b`) in front of one fast fake worker (`benchmarks.lib.fake_worker`) and one
sidecar, measured in interleaved rounds (the order alternating), so that whatever the
machine does meanwhile falls on both. Cases (`--cases`), each at concurrency 1:

- `ttft`: the time to the first event of a streamed chat request without a session (the
  worker measured directly in the same round, for the ratio to direct);
- `turn` and `chat-turn`: a session turn's latency (p50), `/v1/completions` with a new
  prompt and `/v1/chat/completions` with a new message, a fresh session every 20 turns.

With `--pin` (the default where there are two CPUs or more) the gateways run on the last
CPU and every other process on the first, as a gateway and its workers sit on different
hosts in production.

Beside each latency, the CPU time each gateway process spent on the case (user + system,
from /proc, per request): on a machine that other work shares, latency moves with what
runs beside it, while a request's CPU time stays close to the code's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.gateway.gateway_measure import AUTH, Case, measure_ours, streamed_chat
from benchmarks.gateway.gateway_stack import Placement, bench_gateway, bench_stack
from benchmarks.lib.util import (
    add_output_arguments,
    add_pin_argument,
    markdown_table,
    plot_path,
    run_meta,
    write_outputs,
)

NAME = "gateway-ab"
CASES = ("ttft", "turn", "chat-turn")
CHAT = streamed_chat("fake", 16)
PLAIN = {"model": "fake", "prompt": "Say something about caches.", "max_tokens": 3}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--a", type=Path, required=True, help="checkout of gateway A")
    p.add_argument("--b", type=Path, required=True, help="checkout of gateway B")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="what to measure")
    p.add_argument("--requests", type=int, default=2000, help="streams per gateway and round")
    p.add_argument(
        "--turn-requests", type=int, default=600, help="session turns per gateway and round"
    )
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    add_pin_argument(p, "gateways on the last CPU, every other process on the first")
    add_output_arguments(p, NAME)


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def ttft(port: int, requests: int, direct: bool) -> float:
    """Median time to first token of `requests` streams, one at a time, in seconds."""
    from benchmarks.gateway.loadgen import Conn, run

    def make(conn: Conn, i: int) -> bytes:
        return conn.build("POST", "/v1/chat/completions", CHAT, None if direct else AUTH)

    r = await run("127.0.0.1", port, make, requests=requests, concurrency=1)
    if r.errors:
        raise RuntimeError(f"{r.errors} errors on port {port}")
    return statistics.median(r.ttfts)


async def turns(port: int, kind: str, requests: int) -> float:
    """Median latency of `requests` session turns (`kind`: completion or chat), one at a
    time, in seconds (`bench gateway`'s session-turn case)."""
    case = Case(kind, "fake", "", PLAIN, [1], requests, session=kind)
    sample = await measure_ours(port, port, case, 1)
    if sample.errors:
        raise RuntimeError(f"{sample.errors} errors on port {port}")
    return sample.p50_ms / 1e3


async def measure(case: str, port: int, args: argparse.Namespace, direct: bool = False) -> float:
    if case == "ttft":
        return await ttft(port, args.requests, direct)
    return await turns(port, "chat" if case == "chat-turn" else "completion", args.turn_requests)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc; 0.0 elsewhere)."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests_of(case: str, args: argparse.Namespace) -> int:
    return args.requests if case == "ttft" else args.turn_requests


async def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ctxcache.supervisor import Supervisor

    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    with tempfile.TemporaryDirectory() as tmp, Supervisor(out=sys.stderr) as sup:
        from benchmarks.lib.stack import Engine

        builder = bench_stack(sup, Path(tmp), (Engine("fake", "fake"),))
        fake = builder.stack.ports["fake"]
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}
        ports = {
            name: builder.gateway(bench_gateway(f"gateway-{name}", tree=tree, env=env)).port
            for name, tree in trees.items()
        }
        pids = {c.name: c.proc.pid for c in sup.children if c.proc is not None}
        if args.pin:
            Placement(sup, apart={f"gateway-{name}" for name in trees}).set(pinned=True)
        for port in ports.values():  # warm up (/ready: the worker and its model are known)
            await ttft(port, min(500, args.requests), direct=False)
        rows: list[dict[str, Any]] = []
        plan = [(rnd, case) for rnd in range(args.rounds) for case in args.cases]
        for rnd, case in tqdm(plan, desc="gateway A/B", unit="case", file=sys.stderr):
            row: dict[str, Any] = {"round": rnd, "case": case}
            if case == "ttft":
                row["direct"] = await measure(case, fake, args, direct=True)
            for name in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                cpu = cpu_seconds(pids[f"gateway-{name}"])
                row[name] = await measure(case, ports[name], args)
                spent = cpu_seconds(pids[f"gateway-{name}"]) - cpu
                row[f"{name}_cpu"] = spent / requests_of(case, args)
            rows.append(row)
    results = [
        {k: v if isinstance(v, int | str) else round(v * 1e6) for k, v in r.items()} for r in rows
    ]
    median = medians(results, args.cases)
    meta = run_meta(
        NAME,
        trees={n: str(t) for n, t in trees.items()},
        pinned=args.pin,
        requests=args.requests,
        turn_requests=args.turn_requests,
        rounds=args.rounds,
        median=median,
    )
    table = _table(results, median)
    write_outputs(args.out, NAME, {"meta": meta, "results": results}, table)
    _plot(plot_path(args, NAME), results, args.cases)
    sys.stdout.write(table)
    return 0


def medians(results: list[dict[str, Any]], cases: list[str]) -> dict[str, dict[str, Any]]:
    """Per case: each side's median over rounds (µs), and the medians of the per-round
    ratios (B ÷ A; for `ttft` also each side ÷ direct)."""
    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        rounds = [r for r in results if r["case"] == case]
        sides = ("direct", "A", "B") if case == "ttft" else ("A", "B")
        m: dict[str, Any] = {
            f"{n}_us": round(statistics.median(r[n] for r in rounds)) for n in sides
        }
        m["b_over_a"] = round(statistics.median(r["B"] / r["A"] for r in rounds), 3)
        for n in ("A", "B"):
            m[f"{n}_cpu_us"] = round(statistics.median(r[f"{n}_cpu"] for r in rounds))
        paired = [r["B_cpu"] / r["A_cpu"] for r in rounds if r["A_cpu"]]  # 10 ms ticks
        m["cpu_b_over_a"] = round(statistics.median(paired), 3) if paired else None
        if case == "ttft":
            for n in ("A", "B"):
                m[f"{n}_over_direct"] = round(
                    statistics.median(r[n] / r["direct"] for r in rounds), 2
                )
        out[case] = m
    return out


def _table(results: list[dict[str, Any]], median: dict[str, dict[str, Any]]) -> str:
    """Each round's p50 (µs) per case and side, and the ratios; then each case's medians."""

    def ratio(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}×"

    body: list[list[object]] = []
    for r in results:
        d = r.get("direct")
        a_d, b_d = (r["A"] / d, r["B"] / d) if d else (None, None)
        body.append(
            [
                r["case"],
                r["round"],
                d or "–",
                r["A"],
                r["B"],
                ratio(a_d),
                ratio(b_d),
                f"{r['B'] / r['A']:.3f}",
                r["A_cpu"],
                r["B_cpu"],
                f"{r['B_cpu'] / r['A_cpu']:.3f}" if r["A_cpu"] else "–",
            ]
        )
    for case, m in median.items():
        body.append(
            [
                case,
                "median",
                m.get("direct_us", "–"),
                m["A_us"],
                m["B_us"],
                ratio(m.get("A_over_direct")),
                ratio(m.get("B_over_direct")),
                f"{m['b_over_a']:.3f}",
                m["A_cpu_us"],
                m["B_cpu_us"],
                "–" if m["cpu_b_over_a"] is None else f"{m['cpu_b_over_a']:.3f}",
            ]
        )
    heads = ["case", "round", "direct µs", "A µs", "B µs", "A ÷ direct", "B ÷ direct", "B ÷ A"]
    heads += ["A CPU µs/req", "B CPU µs/req", "CPU B ÷ A"]
    return markdown_table(heads, body)


def _plot(path: Path, results: list[dict[str, Any]], cases: list[str]) -> None:
    """Each round's B ÷ A, per case (below 1: B is faster)."""
    from benchmarks.lib.util import bar_plot

    rounds = sorted({r["round"] for r in results})
    series = {case: [r["B"] / r["A"] for r in results if r["case"] == case] for case in cases}
    labels = [f"round {i}" for i in rounds]
    bar_plot(
        path,
        "B ÷ A per round, each case at concurrency 1 (below 1: B faster)",
        labels,
        series,
        "B ÷ A",
    )
