"""`ctxcache bench gateway-calls`: Python function calls per session turn in the gateway.

Latency on a shared 2-vCPU machine moves by more than a refactor's cost (`bench gateway-ab`
rounds of the same code differ by 2×). What a turn costs the gateway in code is steadier:
this counts the function calls of `--turns` session turns (completion and chat, a fresh
session every 20 turns, as in `bench gateway`) under `cProfile`, the gateway's app run in
this process (`create_app`, its in-process manager on a real Redis we start) in front of
the fake worker (`benchmarks.lib.fake_worker`, a process of its own). `--against PATH`
counts another checkout the same way, in a process of its own with that checkout first on
its path, alternating with this one for `--rounds` rounds.

Counts move a little between runs (lock renewals and health checks run on timers), so
compare the medians of a few rounds. Calls in code under the checkout's `gateway/` are
reported apart from the rest (Redis client, HTTP client, Starlette, asyncio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "gateway-calls"
KINDS = ("completion", "chat")
ROOT = Path(__file__).resolve().parents[2]  # this checkout


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments

    p.add_argument("--turns", type=int, default=300, help="measured turns per kind and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (alternating checkouts)")
    p.add_argument("--against", type=Path, default=None, help="another checkout, counted beside")
    p.add_argument("--quick", action="store_true", help="a short run (40 turns, one round)")
    add_output_arguments(p, NAME)


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from benchmarks.lib.util import bar_plot, markdown_table, plot_path, run_meta, write_outputs

    turns, rounds = (40, 1) if args.quick else (args.turns, args.rounds)
    trees = {"this": ROOT}
    if args.against is not None:
        trees["against"] = args.against.resolve()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    plan = [
        (r, name)
        for r in range(rounds)
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1])
    ]
    for _, name in tqdm(plan, desc=NAME, unit="run", file=sys.stderr):
        runs[name].append(_child(trees[name], turns))
    rows = []
    for kind in KINDS:
        row: dict[str, Any] = {"kind": kind}
        for name in trees:
            row[f"{name}_calls"] = round(statistics.median(r[kind]["calls"] for r in runs[name]))
            row[f"{name}_gateway"] = round(
                statistics.median(r[kind]["gateway"] for r in runs[name])
            )
        rows.append(row)
    heads = ["kind", "calls / turn", "of them in gateway/"]
    if "against" in trees:
        heads += ["against: calls / turn", "against: in gateway/", "this ÷ against (all)"]
    body = []
    for row in rows:
        line: list[object] = [row["kind"], row["this_calls"], row["this_gateway"]]
        if "against" in trees:
            ratio = row["this_calls"] / row["against_calls"]
            line += [row["against_calls"], row["against_gateway"], f"{ratio:.3f}"]
        body.append(line)
    table = markdown_table(heads, body)
    meta = run_meta(NAME, turns=turns, rounds=rounds, trees={n: str(t) for n, t in trees.items()})
    write_outputs(args.out, NAME, {"meta": meta, "results": rows, "runs": runs}, table)
    series = {
        f"{name}: {what}": [row[f"{name}_{key}"] for row in rows]
        for name in trees
        for what, key in (("all", "calls"), ("in gateway/", "gateway"))
    }
    title = "Python function calls per session turn (median of rounds)"
    bar_plot(plot_path(args, NAME), title, list(KINDS), series, "calls / turn")
    sys.stdout.write(table)
    return 0


def _child(tree: Path, turns: int) -> dict[str, Any]:
    """One count in a process of its own: this file run as a script, `tree` first on its
    path (-P: not this file's folder), so the gateway counted is `tree`'s."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    argv = [sys.executable, "-P", str(Path(__file__).resolve()), str(turns)]
    proc = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"gateway-calls in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def count(turns: int) -> dict[str, dict[str, float]]:
    """Calls per turn of each kind in this process's gateway: Redis and the fake worker
    started here, then `_count`."""
    from ctxcache.net import free_port
    from ctxcache.redis_server import RedisServer

    fake = (
        "benchmarks.lib.fake_worker"
        if (Path.cwd() / "benchmarks" / "lib" / "fake_worker.py").exists()
        else "benchmarks.fake_worker"  # a checkout from before benchmarks/lib
    )
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis").start()
        port = free_port()
        worker = subprocess.Popen([sys.executable, "-m", fake, "--port", str(port)])
        try:
            _wait_health(port)
            return asyncio.run(_count(turns, port, redis.url))
        finally:
            worker.terminate()
            worker.wait()
            redis.stop()


async def _count(turns: int, port: int, redis_url: str) -> dict[str, dict[str, float]]:
    """`_turns` of each kind under cProfile, the app in this process."""
    import cProfile
    import pstats

    import httpx

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    gateway_dir = str(Path.cwd() / "gateway") + os.sep
    out: dict[str, dict[str, float]] = {}
    settings = GatewaySettings(workers=[f"http://127.0.0.1:{port}"], redis_url=redis_url)
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            await _wait_models(c)
            for kind in KINDS:
                await _turns(c, kind, 40)  # warm: connections, caches
                prof = cProfile.Profile()
                prof.enable()
                await _turns(c, kind, turns)
                prof.disable()
                stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
                total = sum(v[1] for v in stats.values())
                ours = sum(v[1] for k, v in stats.items() if k[0].startswith(gateway_dir))
                out[kind] = {"calls": total / turns, "gateway": ours / turns}
    return out


def _wait_health(port: int) -> None:
    import httpx

    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health").raise_for_status()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


async def _wait_models(c: Any) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = await c.get("/v1/models")
        if r.status_code == 200 and r.json()["data"]:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the gateway's pool never listed the fake worker's model")


async def _turns(c: Any, kind: str, n: int) -> None:
    """`n` session turns of `kind`, a fresh session every 20 (as `bench gateway`)."""
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    new: dict[str, Any] = (
        {"prompt": "more"}
        if kind == "completion"
        else {"messages": [{"role": "user", "content": "more"}]}
    )
    sid = None
    for i in range(n):
        if i % 20 == 0:
            create: dict[str, Any] = {"model": "fake", "ttl": 600}
            if kind == "completion":
                create["prompt"] = "a document"
            else:
                create["messages"] = [{"role": "system", "content": "a document"}]
            r = await c.post("/v1/context", json=create)
            r.raise_for_status()
            sid = r.json()["session_id"]
        r = await c.post(path, json={"model": "fake", "max_tokens": 3, "session_id": sid} | new)
        r.raise_for_status()


if __name__ == "__main__":  # the child of `_child`
    sys.stdout.write(json.dumps(count(int(sys.argv[1]))) + "\n")
