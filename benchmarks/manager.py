"""`ctxcache bench manager`: session operations per second vs raw redis-py round trips.

Everything runs against a redis-server the benchmark starts itself, in one run:
raw redis-py GET/SET (the ceiling for one round trip), then session get / create / turn
through the manager's in-process client (`LocalManager`, the `ctxcache serve` path) and
through the service layer directly (the client's own cost: now nearly none).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments

    p.add_argument(
        "--ops", type=int, default=None, help="operations per measurement (3000; 300 --quick)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--history", type=int, default=1000, help="tokens already in the session")
    p.add_argument("--new-tokens", type=int, default=150, help="tokens appended per turn")
    add_output_arguments(p, "manager")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median kept)")
    p.add_argument("--quick", action="store_true", help="a short run (ops=300 unless --ops)")


def main(args: argparse.Namespace) -> int:
    if args.ops is None:
        args.ops = 300 if args.quick else 3000
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import logging

    import redis.asyncio as aioredis
    from tqdm import tqdm

    from benchmarks.lib.util import (
        Result,
        bar_plot,
        markdown_table,
        measure,
        plot_path,
        run_meta,
        write_outputs,
    )
    from cache_manager.app import create_app
    from cache_manager.client import ManagerClient
    from cache_manager.protocol import AppendTurn, BeginTurn, CreateSession
    from cache_manager.settings import ManagerSettings
    from cache_manager.sidecar_link import NullSidecarLink
    from ctxcache.redis_server import RedisServer

    logging.getLogger().setLevel(logging.WARNING)
    ops = args.ops
    meta = run_meta(
        "manager",
        history_tokens=args.history,
        new_tokens=args.new_tokens,
        ops=ops,
        rounds=args.rounds,
        concurrency=args.concurrency,
    )
    history = list(range(args.history))
    new = list(range(args.new_tokens))
    results = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        settings = ManagerSettings(redis_url=server.url)
        raw = aioredis.Redis.from_url(server.url, max_connections=256)
        app = create_app(settings, sidecar_link=NullSidecarLink())
        async with ManagerClient.in_process(app) as client:
            svc = app.state.service
            await raw.set("bench:k", b"x" * 64)
            seed = [
                (
                    await client.create(
                        CreateSession(tenant="bench", model="m", kind="chat", tokens=history)
                    )
                ).session_id
                for _ in range(64)
            ]

            async def raw_get(i: int) -> Any:
                return await raw.get("bench:k")

            async def raw_set(i: int) -> Any:
                return await raw.set(f"bench:s{i % 64}", b"x" * 64)

            async def get(i: int) -> Any:
                return await client.get(seed[i % len(seed)], "bench")

            async def create(i: int) -> Any:
                return await client.create(
                    CreateSession(tenant="bench", model="m", kind="chat", tokens=new, ttl=600)
                )

            def turn_with(api: Any) -> Any:
                async def turn(i: int) -> Any:
                    sid = seed[i % len(seed)]
                    while True:
                        state = await api.begin(sid, BeginTurn(tenant="bench", tokens=True))
                        return await api.append(
                            sid,
                            AppendTurn(
                                tenant="bench",
                                expected_version=state.info.version,
                                lock=state.lock,
                                tokens=new,
                            ),
                        )

                return turn

            async def svc_get(i: int) -> Any:
                return await svc.get(seed[i % len(seed)], "bench")

            plan = [
                ("redis-py GET (1 round trip)", raw_get),
                ("redis-py SET (1 round trip)", raw_set),
                ("session get, in-process client", get),
                ("session get, service direct", svc_get),
                ("session create, in-process client", create),
                ("session turn, in-process client", turn_with(client)),
                ("session turn, service direct", turn_with(svc)),
            ]
            rounds = args.rounds
            per_round = max(1, ops // rounds)
            total = per_round * rounds * len(plan) * len(args.concurrency)
            with tqdm(total=total, desc="manager bench", unit="op") as bar:
                for conc in args.concurrency:
                    # turns on one session serialize on its lock: spread them
                    c = min(conc, len(seed))
                    samples: dict[str, list[Result]] = {name: [] for name, _ in plan}
                    for _ in range(rounds):  # interleaved, so noise hits every row alike
                        for name, op in plan:
                            samples[name].append(
                                await measure(
                                    name, op, ops=per_round, concurrency=c, progress=bar.update
                                )
                            )
                    results.extend(_median_result(samples[name]) for name, _ in plan)
        await raw.aclose()

    ceiling = {r.concurrency: r.ops_per_s for r in results if r.name.startswith("redis-py GET")}
    rows = [
        [
            r.name,
            r.concurrency,
            r.ops_per_s,
            r.p50_ms,
            r.p99_ms,
            f"{100 * r.ops_per_s / ceiling[r.concurrency]:.0f}%",
        ]
        for r in results
    ]
    table = markdown_table(
        ["operation", "concurrency", "ops/s", "p50 ms", "p99 ms", "vs raw GET"], rows
    )
    paths = write_outputs(
        args.out, "manager", {"meta": meta, "results": [r.row() for r in results]}, table
    )
    labels = [r.name for r in results if r.concurrency == args.concurrency[0]]
    series = {
        f"concurrency {c}": [r.ops_per_s for r in results if r.concurrency == c]
        for c in args.concurrency
    }
    paths.append(plot_path(args, "manager"))
    bar_plot(
        paths[-1],
        "Context Cache Manager ops/s",
        labels,
        series,
        "operations / s",
    )
    print(table)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _median_result(samples: list[Any]) -> Any:
    """The round with the median throughput stands for the operation."""
    ordered = sorted(samples, key=lambda r: r.ops_per_s)
    return ordered[len(ordered) // 2]
