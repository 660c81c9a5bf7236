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
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.gateway import AUTH, KEY

CHAT = {
    "model": "fake",
    "messages": [{"role": "user", "content": "Say something about caches."}],
    "max_tokens": 16,
    "temperature": 0,
    "stream": True,
}


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
    p.add_argument("--out", type=Path, default=None, help="write the result here (JSON)")


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
        for port in ports.values():  # warm up (the pool finds the worker's model first)
            await _until_routed(port)
            await ttft(port, 500, direct=False)
        rows: list[dict[str, float]] = []
        for rnd in tqdm(range(args.rounds), desc="rounds", unit="round", file=sys.stderr):
            row = {"direct": await ttft(fake, args.requests, direct=True)}
            for name in ("A", "B") if rnd % 2 == 0 else ("B", "A"):
                row[name] = await ttft(ports[name], args.requests, direct=False)
            rows.append(row)
    result = _summary(args, trees, rows)
    sys.stdout.write(_report(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
    return 0


async def _until_routed(port: int) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=AUTH) as http:
        for _ in range(300):
            models = (await http.get("/v1/models")).json()["data"]
            if models:
                return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"the gateway on port {port} lists no model")


def _summary(
    args: argparse.Namespace, trees: dict[str, Path], rows: list[dict[str, float]]
) -> dict[str, object]:
    ratios = {n: statistics.median(r[n] / r["direct"] for r in rows) for n in ("A", "B")}
    return {
        "command": "ctxcache bench gateway-ab " + " ".join(sys.argv[3:]),
        "trees": {n: str(t) for n, t in trees.items()},
        "pinned": args.pin,
        "requests": args.requests,
        "rounds_us": [{k: round(v * 1e6) for k, v in r.items()} for r in rows],
        "ttft_p50_us": {n: round(statistics.median(r[n] for r in rows) * 1e6) for n in rows[0]},
        "ratio_to_direct": {n: round(v, 2) for n, v in ratios.items()},
    }


def _report(result: dict[str, object]) -> str:
    lines = [f"{'round':>5} {'direct':>8} {'A':>8} {'B':>8}   A÷direct B÷direct"]
    for i, r in enumerate(result["rounds_us"]):  # type: ignore[arg-type]
        a, b, d = r["A"], r["B"], r["direct"]
        lines.append(f"{i:>5} {d:>6}µs {a:>6}µs {b:>6}µs   {a / d:>7.2f}× {b / d:>7.2f}×")
    ratio = result["ratio_to_direct"]
    lines.append(f"median ratio to direct: A {ratio['A']}×, B {ratio['B']}×")  # type: ignore[index]
    return "\n".join(lines) + "\n"
