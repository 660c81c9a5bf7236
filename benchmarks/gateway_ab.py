"""`ctxcache bench gateway-ab`: the streaming TTFT of two checkouts' gateways, side by side.

`bench gateway` measures one gateway against calling the worker directly. On a small VM its
streaming TTFT at concurrency 1 moves by ±0.4× of direct from one round to the next: with
three processes (load generator, gateway, worker) on two CPUs, where the scheduler places
them decides more than a change of 50 µs in the gateway does. This bench answers "is B
faster than A?" instead: two gateways (each started from its own checkout, `--a` and
`--b`) in front of one fast fake worker (`benchmarks.fake_worker`), measured in interleaved
rounds (the order alternating), each round's time to first token over `--requests`
streamed chat requests at concurrency 1, and the worker measured directly in every round
for the ratio. With `--pin` (the default where there are two CPUs or more) every process
runs on a fixed CPU: the gateways on the last one, the fake worker and the load generator
on the first, as a gateway and its workers sit on different hosts in production.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.gateway import AUTH, KEY, streamed_chat
from benchmarks.util import add_output_arguments, markdown_table, plot_path, run_meta, write_outputs

NAME = "gateway-ab"

CHAT = streamed_chat("fake", 16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--a", type=Path, required=True, help="checkout of gateway A")
    p.add_argument("--b", type=Path, required=True, help="checkout of gateway B")
    p.add_argument("--requests", type=int, default=2000, help="streams per gateway and round")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=(os.cpu_count() or 1) >= 2,
        help="gateways on the last CPU, worker and generator on the first (default: on "
        "where there are two CPUs or more)",
    )
    add_output_arguments(p, NAME)


def main(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


def pin(pid: int, cpu: int) -> None:
    """Every thread of process `pid` onto `cpu` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


async def ttft(port: int, requests: int, direct: bool) -> float:
    """Median time to first token of `requests` streams, one at a time, in seconds."""
    from benchmarks.loadgen import Conn, run

    def make(conn: Conn, i: int) -> bytes:
        return conn.build("POST", "/v1/chat/completions", CHAT, None if direct else AUTH)

    r = await run("127.0.0.1", port, make, requests=requests, concurrency=1)
    if r.errors:
        raise RuntimeError(f"{r.errors} errors on port {port}")
    return statistics.median(r.ttfts)


async def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ctxcache.net import free_port
    from ctxcache.redis_server import RedisServer
    from ctxcache.supervisor import Child, Supervisor, http_ready

    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    with tempfile.TemporaryDirectory() as tmp, Supervisor(out=sys.stderr) as sup:
        redis = RedisServer(Path(tmp) / "redis")
        redis.data_dir.mkdir(parents=True)
        sup.start(Child("redis", redis.argv(), ready=redis.wait_ready))
        fake = free_port()
        argv = [sys.executable, "-m", "benchmarks.fake_worker", "--port", str(fake)]
        worker = sup.start(Child("fake", argv, ready=http_ready(f"http://127.0.0.1:{fake}/health")))
        ports: dict[str, int] = {}
        gateways: list[Child] = []
        for name, tree in trees.items():
            ports[name] = free_port()
            # -P: the checkout on PYTHONPATH, not the working directory, is imported
            argv = [sys.executable, "-P", "-m", "ctxcache.cli", "gateway"]
            argv += ["--port", str(ports[name])]
            argv += ["--redis-url", redis.url, "--api-key", f"{KEY}=bench"]
            argv += ["--worker", f"http://127.0.0.1:{fake}", "--log-level", "WARNING"]
            env = {"PYTHONPATH": str(tree), "OTEL_EXPORTER_OTLP_ENDPOINT": ""}
            ready = http_ready(f"http://127.0.0.1:{ports[name]}/ready")
            gateways.append(sup.start(Child(f"gateway-{name}", argv, ready=ready, env=env)))
        if args.pin:
            last = max(os.sched_getaffinity(0))
            first = min(os.sched_getaffinity(0))
            for child in gateways:
                assert child.proc is not None
                pin(child.proc.pid, last)
            assert worker.proc is not None
            pin(worker.proc.pid, first)
            pin(os.getpid(), first)
        for port in ports.values():  # warm up (/ready: the worker and its model are known)
            await ttft(port, min(500, args.requests), direct=False)
        rows: list[dict[str, float]] = []
        for rnd in tqdm(range(args.rounds), desc="rounds", unit="round", file=sys.stderr):
            row = {"direct": await ttft(fake, args.requests, direct=True)}
            for name in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                row[name] = await ttft(ports[name], args.requests, direct=False)
            rows.append(row)
    results = [{k: round(v * 1e6) for k, v in row.items()} for row in rows]  # µs
    median = {
        "ttft_p50_us": {n: round(statistics.median(r[n] for r in rows) * 1e6) for n in rows[0]},
        "ratio_to_direct": {
            n: round(statistics.median(r[n] / r["direct"] for r in rows), 2) for n in ("A", "B")
        },
    }
    meta = run_meta(
        NAME,
        trees={n: str(t) for n, t in trees.items()},
        pinned=args.pin,
        requests=args.requests,
        rounds=args.rounds,
        median=median,
    )
    table = _table(results, median)
    write_outputs(args.out, NAME, {"meta": meta, "results": results}, table)
    _plot(plot_path(args, NAME), results)
    sys.stdout.write(table)
    return 0


def _table(rounds: list[dict[str, int]], median: dict[str, Any]) -> str:
    """Each round's TTFT p50 (µs) and ratios to direct, then the medians over rounds."""
    body: list[list[object]] = []
    for i, r in enumerate(rounds):
        a, b, d = r["A"], r["B"], r["direct"]
        body.append([i, d, a, b, f"{a / d:.2f}×", f"{b / d:.2f}×"])
    p50, ratio = median["ttft_p50_us"], median["ratio_to_direct"]
    body.append(["median", p50["direct"], p50["A"], p50["B"], f"{ratio['A']}×", f"{ratio['B']}×"])
    heads = ["round", "direct µs", "A µs", "B µs", "A ÷ direct", "B ÷ direct"]
    return markdown_table(heads, body)


def _plot(path: Path, rounds: list[dict[str, int]]) -> None:
    """Each round's TTFT ÷ direct, A beside B."""
    from benchmarks.util import bar_plot

    series = {n: [r[n] / r["direct"] for r in rounds] for n in ("A", "B")}
    labels = [f"round {i}" for i in range(len(rounds))]
    bar_plot(path, "streaming TTFT at concurrency 1 ÷ direct", labels, series, "ratio")
