"""The stack `ctxcache bench load` runs against, and what it observes of it: the
processes' RSS (`Sampler`) and the Redis keys and sidecar stats that must return to their
baseline (`snapshot`, `same_as`). The stack comes from the one stack builder
(benchmarks/lib/stack.py). See benchmarks/load/load.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from benchmarks.lib.util import ensure_preset, rss_mib

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
    """Redis (a cluster with `--redis cluster`), a sidecar, `--workers` engines (the fake
    worker, or the tiny model's worker storing into the sidecar) and the gateway."""
    from benchmarks.lib.stack import Engine, Gateway, StackBuilder, StackSettings, SupervisorRunner
    from ctxcache.supervisor import Supervisor

    model = "fake"
    if args.backend == "tiny":
        model = "tiny"
        ensure_preset("tiny", args.model_dir, quiet=True)
    tiny = ("--model-name", "tiny", "--worker-id", "0")

    def engine(i: int) -> Engine:
        if args.backend == "fake":
            return Engine("fake", f"worker{i}", startup_timeout=300.0)
        return Engine("builtin", f"worker{i}", tiny, args.model_dir, True, startup_timeout=300.0)

    engines = tuple(engine(i) for i in range(args.workers))
    env = {"CTX_GATEWAY_MIN_TTL": "1", "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5"}
    settings = StackSettings(
        redis="cluster" if args.redis == "cluster" else "bundled",
        redis_appendonly=False,
        sidecar=("--memory-bytes", str(512 * 2**20)),
        engines=engines,
        gateway=Gateway(keys={KEY: TENANT}, env=env),
    )
    with (
        Supervisor(out=logs) as sup,
        StackBuilder(settings, tmp, SupervisorRunner(sup)).started() as stack,
    ):
        pids = {name: stack.pids[name] for name in ("gateway", *(e.name for e in engines))}
        yield Stack(stack.gateway, KEY, model, stack.redis_url, stack.sidecar, pids)


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
