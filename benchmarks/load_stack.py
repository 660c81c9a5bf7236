"""The stack `ctxcache bench load` runs against, and what it observes of it: the
processes' RSS (`Sampler`) and the Redis keys and sidecar stats that must return to their
baseline (`snapshot`, `same_as`). See benchmarks/load.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from benchmarks.util import rss_mib

KEY = "load-key"
TENANT = "load"


# -- the stack --------------------------------------------------------------------------------
@dataclass
class Stack:
    gateway: str
    api_key: str
    model: str
    redis_url: str | None
    sidecar: str | None
    pids: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def own_stack(args: argparse.Namespace, tmp: Path, logs: IO[str]) -> Iterator[Stack]:
    from ctxcache.net import free_port
    from ctxcache.redis_server import RedisServer
    from ctxcache.supervisor import Child, Supervisor, http_ready

    cli = [sys.executable, "-m", "ctxcache.cli"]
    with Supervisor(out=logs) as sup, contextlib.ExitStack() as stores:
        if args.redis == "cluster":
            from ctxcache.redis_topologies import RedisClusterServers

            cluster = RedisClusterServers(tmp / "cluster")
            stores.callback(cluster.stop)
            redis_url = cluster.start().url
        else:
            redis = RedisServer(tmp / "redis", appendonly=False)
            redis.data_dir.mkdir(parents=True)
            sup.start(Child("redis", redis.argv(), ready=redis.wait_ready))
            redis_url = redis.url
        data_port, control_port = free_port(), free_port()
        sidecar = f"http://127.0.0.1:{control_port}"
        sidecar_argv = ["sidecar", "--port", str(data_port), "--control-port", str(control_port)]
        sup.start(
            Child(
                "sidecar",
                [*cli, *sidecar_argv, "--memory-bytes", str(512 * 2**20)],
                ready=http_ready(f"{sidecar}/health"),
            )
        )
        model = "fake"
        if args.backend == "tiny":
            model = "tiny"
            if not (args.model_dir / "config.json").exists():
                from worker.presets.model import create_model

                create_model("tiny", args.model_dir)
        workers: list[Child] = []
        ports = [free_port() for _ in range(args.workers)]
        for i, port in enumerate(ports):
            if args.backend == "fake":
                argv = [sys.executable, "-m", "benchmarks.fake_worker", "--port", str(port)]
            else:
                argv = [
                    *cli,
                    "worker",
                    "--model",
                    str(args.model_dir),
                    "--model-name",
                    "tiny",
                    "--port",
                    str(port),
                    "--sidecar",
                    f"lm://127.0.0.1:{data_port}",
                    "--worker-id",
                    "0",
                ]
            workers.append(
                Child(
                    f"worker{i}",
                    argv,
                    startup_timeout=300.0,
                    ready=http_ready(f"http://127.0.0.1:{port}/health"),
                )
            )
        for w in workers:
            sup.start(w)
        gw_port = free_port()
        argv = [
            *cli,
            "gateway",
            "--port",
            str(gw_port),
            "--redis-url",
            redis_url,
            "--api-key",
            f"{KEY}={TENANT}",
            "--log-level",
            "WARNING",
        ]
        for port in ports:
            argv += ["--worker", f"http://127.0.0.1:{port}={sidecar}"]
        env = {"CTX_GATEWAY_MIN_TTL": "1", "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5"}
        gw = sup.start(
            Child(
                "gateway",
                argv,
                env=env,
                startup_timeout=120.0,
                ready=http_ready(f"http://127.0.0.1:{gw_port}/ready"),
            )
        )
        pids = {c.name: c.proc.pid for c in [gw, *workers] if c.proc is not None}
        yield Stack(f"http://127.0.0.1:{gw_port}", KEY, model, redis_url, sidecar, pids)


# -- observing the stack ----------------------------------------------------------------------
@dataclass
class Sampler:
    pids: dict[str, int]
    t0: float = field(default_factory=time.monotonic)
    inflight: int = 0
    rows: list[dict[str, float]] = field(default_factory=list)

    def sample(self) -> None:
        row = {"t": time.monotonic() - self.t0, "inflight": float(self.inflight)}
        row.update({name: rss_mib(pid) for name, pid in self.pids.items()})
        self.rows.append(row)

    async def run(self, every: float = 0.25) -> None:
        while True:
            self.sample()
            await asyncio.sleep(every)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            name: {
                "start": round(self.rows[0][name], 1),
                "peak": round(max(r[name] for r in self.rows), 1),
                "end": round(self.rows[-1][name], 1),
            }
            for name in self.pids
        }


async def snapshot(stack: Stack) -> dict[str, Any]:
    """Redis keys (SCAN, which also reaps expired ones it meets) and the sidecar's stats."""
    out: dict[str, Any] = {}
    if stack.redis_url:
        from cache_manager.redis_url import open_store_redis

        async with open_store_redis(stack.redis_url, timeout_s=10) as client:
            # on a cluster, SCAN and DBSIZE cover every master
            out["redis_keys"] = sorted([k.decode() async for k in client.scan_iter(count=1000)])
            out["redis_dbsize"] = int(await client.dbsize())
    if stack.sidecar:
        async with httpx.AsyncClient(timeout=10) as c:
            stats = (await c.get(f"{stack.sidecar}/stats")).json()
        keep = (
            "blocks",
            "memory_bytes_used",
            "disk_bytes_used",
            "pinned_bytes",
            "pinned_sessions",
            "sessions",
        )
        out["sidecar"] = {k: stats[k] for k in keep}
    return out


def same_as(base: dict[str, Any], now: dict[str, Any]) -> bool:
    return base.get("redis_keys") == now.get("redis_keys") and base.get("sidecar") == now.get(
        "sidecar"
    )
