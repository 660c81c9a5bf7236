"""`ctxcache bench sessions`: one node as its live sessions grow to 100k, and the sidecar's
pin policies as the idle working set grows past its memory tier.

Part 1 (sizes, `--max`): a stack of its own — a Redis, a KV sidecar, the fake engine
(benchmarks/lib/fake_worker.py with `--sidecar`: no model runs, but every session turn looks up
and stores made-up KV in the real sidecar, so hits, pins and bytes are real) and a gateway
with its in-process manager. For each size (1k, 10k, 100k live sessions):

- a new active set (`--active`, 200) is created through the gateway, as clients do, and the
  previous one joins the idle mass;
- the idle mass is filled up to the size in bulk, through the manager's own code
  (`SessionService.create`, the function behind `POST /sessions`, on the same Redis): real
  sessions the gateway serves (any of them can be read or take a turn), with the same
  records, token ids and messages a create through the gateway writes, but no engine call,
  so no KV and no sidecar pin (they stand for sessions whose KV the sidecar already let go);
  with `--implicit`, as many implicit conversations too (`sessions_implicit.py`);
- then a mixed load runs through the gateway (`--ops` operations, `--concurrency` clients):
  turns of the active sessions, creates of short-lived sessions (ttl 2–8 s: expiries go on
  all the time), reads of random sessions (GET, which also asks the sidecar) and listings;
  with `--implicit`, also requests without a session: turns of an active set of implicit
  conversations (the whole conversation resent) and new conversations' first requests;
- measured: Redis bytes per session (INFO `used_memory` over the baseline, and `MEMORY
  USAGE` of sampled sessions' keys), the sidecar's bytes per session in each tier, p50/p99
  latency of each operation from the client, Redis' expiry cycle (keys expired, CPU ms),
  the active sessions' sidecar hit rate (cached tokens / tokens in full chunks) and the RSS
  of every process.

The stack and the bulk creation are in `sessions_stack.py`, the outputs in
`sessions_report.py`. Part 2 (`sessions_kv.py`): the sidecar alone, driven over lm:// and
its control API.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lib.util import rss_mib
from benchmarks.sessions.sessions_implicit import (
    IMPLICIT_MIX,
    Conversations,
    delta,
    fill_implicit,
    implicit_after,
    live_implicit,
    results,
)
from benchmarks.sessions.sessions_stack import (
    CHUNK,
    KEY,
    MODEL,
    TENANT,
    Stack,
    bulk_create,
    context_create,
    context_messages,
    own_stack,
)

log = logging.getLogger("ctxcache.bench.sessions")

SIZES = (1_000, 10_000, 100_000)
QUICK_SIZES = (300, 1_000)
# operation -> weight in the mixed load
MIX = {"turn": 60, "create": 15, "get": 15, "list": 10}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments
    from benchmarks.sessions.sessions_kv import add_kv_arguments

    p.add_argument("--max", type=int, default=SIZES[-1], help="largest size (live sessions)")
    p.add_argument("--sizes", default=None, help="comma-separated sizes (default 1k,10k,100k)")
    p.add_argument("--active", type=int, default=0, help="active sessions (200; --quick 20)")
    p.add_argument("--ops", type=int, default=0, help="mixed operations a size (6000; quick 150)")
    p.add_argument("--concurrency", type=int, default=4, help="clients of the mixed load")
    p.add_argument("--bulk-concurrency", type=int, default=48, help="bulk creates in flight")
    p.add_argument("--context-words", type=int, default=100, help="words of a session's text")
    p.add_argument("--kv-bytes-per-token", type=int, default=128, help="the fake engine's KV")
    p.add_argument("--sidecar-memory-mib", type=int, default=512, help="part 1's sidecar")
    p.add_argument("--kv-only", action="store_true", help="only part 2 (the pin policies)")
    p.add_argument("--skip-kv", action="store_true", help="only part 1 (the sizes)")
    p.add_argument(
        "--implicit",
        action="store_true",
        help="part 1 with as many implicit conversations (no session_id) as sessions",
    )
    add_kv_arguments(p)
    add_output_arguments(p, "sessions")
    p.add_argument("--quick", action="store_true", help="a small run (explicit options win)")
    p.add_argument("--no-progress", action="store_true")


def sizes_of(args: argparse.Namespace) -> list[int]:
    if args.sizes:
        return sorted(int(s) for s in args.sizes.split(","))
    return [s for s in (QUICK_SIZES if args.quick else SIZES) if s <= args.max]


def main(args: argparse.Namespace) -> int:
    from benchmarks.sessions.sessions_kv import kv_policies
    from benchmarks.sessions.sessions_report import report
    from ctxcache.logs import setup_logging

    setup_logging("bench")
    args.active = args.active or (20 if args.quick else 200)
    args.ops = args.ops or (150 if args.quick else 6000)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    kv_rows: list[dict[str, Any]] = []
    with (args.out / "sessions-stack.log").open("w") as logs:
        if not args.kv_only:
            with tempfile.TemporaryDirectory() as tmp, own_stack(args, Path(tmp), logs) as stack:
                rows = asyncio.run(grow(args, stack))
        if not args.skip_kv:
            kv_rows = kv_policies(args, logs)
    return report(args, rows, kv_rows)


# -- the load -----------------------------------------------------------------------------------
@dataclass
class Window:
    """What the mixed load of one size saw."""

    latencies: dict[str, list[float]]
    errors: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0
    chunk_tokens: int = 0
    implicit_cached: int = 0  # the same, of implicit turns
    implicit_chunk: int = 0


@dataclass
class Load:
    args: argparse.Namespace
    http: httpx.AsyncClient
    rng: random.Random = field(default_factory=lambda: random.Random(27))
    known: list[str] = field(default_factory=list)  # every long-lived session id
    free: list[str] = field(default_factory=list)  # active sessions with no turn in flight
    context: dict[str, int] = field(default_factory=dict)  # active session -> its tokens
    conversations: Conversations | None = None  # --implicit: the implicit clients

    @property
    def mix(self) -> dict[str, int]:
        return {**MIX, **IMPLICIT_MIX} if self.conversations is not None else MIX

    def window(self) -> Window:
        return Window({k: [] for k in self.mix})

    async def call(self, w: Window, op: str, method: str, url: str, body: Any = None) -> Any:
        t0 = time.perf_counter()
        r = await self.http.request(method, url, json=body)
        if r.status_code >= 400:
            key = f"{op} {r.status_code}"
            w.errors[key] = w.errors.get(key, 0) + 1
            if w.errors[key] <= 3:
                log.warning("%s %s: %s %s", method, url, r.status_code, r.text[:200])
            return None
        w.latencies[op].append(time.perf_counter() - t0)
        return r.json()

    def create_body(self, ttl: int) -> dict[str, Any]:
        messages = context_messages(self.rng, self.args.context_words)
        return {"model": MODEL, "messages": messages, "ttl": ttl, "max_tokens": 0}

    async def create_active(self, w: Window) -> None:
        out = await self.call(w, "create", "POST", "/v1/context", self.create_body(3600))
        if out is not None:
            self.known.append(out["session_id"])
            self.free.append(out["session_id"])
            self.context[out["session_id"]] = out["session"]["context_tokens"]

    async def op(self, w: Window, name: str) -> None:
        if name == "turn" and self.free:
            sid = self.free.pop(self.rng.randrange(len(self.free)))
            body = {
                "model": MODEL,
                "session_id": sid,
                "messages": [{"role": "user", "content": f"And what about {self.rng.random()}?"}],
                "max_tokens": 3,
                "temperature": 0,
            }
            try:
                out = await self.call(w, "turn", "POST", "/v1/chat/completions", body)
            finally:
                self.free.append(sid)
            if out is not None:
                # what the sidecar could hold: the full chunks of the context before the
                # turn (the chunk the new tokens complete is computed, never found)
                could = self.context[sid] // CHUNK * CHUNK
                cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                w.cached_tokens += min(cached, could)
                w.chunk_tokens += could
                self.context[sid] = out["session"]["context_tokens"]
        elif name == "create":
            ttl = self.rng.randint(2, 8)  # short-lived: they expire during the run
            await self.call(w, "create", "POST", "/v1/context", self.create_body(ttl))
        elif name == "get":
            sid = self.known[self.rng.randrange(len(self.known))]
            await self.call(w, "get", "GET", f"/v1/context/{sid}")
        elif name == "list":
            await self.call(w, "list", "GET", "/v1/context", None)
        elif name == "implicit" and self.conversations is not None:
            await self.conversations.turn(self.call, w)
        elif name == "implicit_new" and self.conversations is not None:
            await self.conversations.start(self.call, w, keep=False)

    async def mixed(self, w: Window, ops: int, bar: Any) -> None:
        names = self.rng.choices(list(self.mix), weights=list(self.mix.values()), k=ops)
        queue = iter(names)

        async def client() -> None:
            for name in queue:
                await self.op(w, name)
                bar.update(1)

        await asyncio.gather(*(client() for _ in range(self.args.concurrency)))


# -- measuring ----------------------------------------------------------------------------------
async def redis_numbers(redis: Any, sample: list[str]) -> dict[str, float]:
    from cache_manager.keys import session_keys, tenant_keys

    memory = await redis.info("memory")
    stats = await redis.info("stats")
    scripts = (await redis.info("commandstats")).get("cmdstat_evalsha", {})
    usage = 0
    for sid in sample:
        for k in session_keys(sid)[:3]:
            usage += int(await redis.memory_usage(k, samples=0) or 0)
    index = 0
    for k in tenant_keys(TENANT)[:4]:
        index += int(await redis.memory_usage(k, samples=5) or 0)
    return {
        "used_memory": float(memory["used_memory"]),
        "expired_keys": float(stats["expired_keys"]),
        "expire_cpu_ms": float(stats.get("expire_cycle_cpu_milliseconds", 0)),
        "stale_perc": float(stats.get("expired_stale_perc", 0)),
        "script_calls": float(scripts.get("calls", 0)),
        "script_usec": float(scripts.get("usec", 0)),
        "session_keys_bytes": usage / max(1, len(sample)),
        "index_bytes": float(index),
        "live": float(
            await redis.zcount(tenant_keys(TENANT)[0], f"({int(time.time() * 1000)}", "+inf")
        ),
    }


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def grow(args: argparse.Namespace, stack: Stack) -> list[dict[str, Any]]:
    import redis.asyncio as aioredis
    from tqdm import tqdm

    from benchmarks.lib.util import percentile

    rows: list[dict[str, Any]] = []
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with (
        httpx.AsyncClient(base_url=stack.gateway, headers=headers, timeout=60, limits=limits) as h,
        httpx.AsyncClient(base_url=stack.sidecar, timeout=30) as sc,
        aioredis.Redis.from_url(stack.redis_url) as redis,
    ):
        base = await redis_numbers(redis, [])
        conv = Conversations(args.context_words) if args.implicit else None
        load = Load(args, h, conversations=conv)
        for size in sizes_of(args):
            w = load.window()
            load.free.clear()  # the previous active set goes idle
            # (a burst of creates, not part of the measured mix)
            await asyncio.gather(*(load.create_active(load.window()) for _ in range(args.active)))
            if conv is not None:
                conv.free.clear()
                starts = (
                    conv.start(load.call, load.window(), keep=True) for _ in range(args.active)
                )
                await asyncio.gather(*starts)
            implicit_live = await live_implicit(redis) if conv is not None else 0
            live = int((await redis_numbers(redis, []))["live"]) - implicit_live
            n = max(0, size - live)
            with tqdm(
                total=n, desc=f"bulk to {size:,}", unit="session", disable=args.no_progress
            ) as bar:
                make = context_create(args.context_words)
                bulk_s = await bulk_create(
                    args, stack, n, bar, make, lambda _, info: load.known.append(info.session_id)
                )
            filled: dict[str, Any] = {}
            if conv is not None:
                filled = await fill_implicit(args, stack, redis, conv, size - implicit_live)
            if not rows:  # warm up the stack (connections, scripts, code paths) unmeasured
                with tqdm(total=args.ops // 5, desc="warm-up", disable=args.no_progress) as bar:
                    await load.mixed(load.window(), args.ops // 5, bar)
            if conv is not None:  # the bulk's conversations are found: a few woken
                seen = results((await h.get("/metrics")).text)
                filled["woken"] = await conv.wake(load.call, load.window())
                filled["woken_results"] = delta(seen, results((await h.get("/metrics")).text))
            before = await redis_numbers(redis, [])
            seen = results((await h.get("/metrics")).text)
            cpu_before = {name: cpu_s(pid) for name, pid in stack.pids.items()}
            sc_before = (await sc.get("/metrics")).text
            t0 = time.perf_counter()
            with tqdm(
                total=args.ops, desc=f"mixed at {size:,}", unit="op", disable=args.no_progress
            ) as bar:
                await load.mixed(w, args.ops, bar)
            window_s = time.perf_counter() - t0
            cpu = {name: cpu_s(pid) - cpu_before[name] for name, pid in stack.pids.items()}
            after = await redis_numbers(redis, random.Random(size).sample(load.known, 200))
            if conv is not None:
                got = delta(seen, results((await h.get("/metrics")).text))
                filled.update(await implicit_after(redis, conv, w, size, got, after["live"]))
            stats = (await sc.get("/stats")).json()
            sc_after = (await sc.get("/metrics")).text
            live = int(after["live"])
            row: dict[str, Any] = {
                "size": size,
                "live_sessions": live,
                "bulk_created": n,
                "bulk_per_s": round(n / bulk_s, 1) if n else None,
                "redis_bytes_per_session": round(
                    (after["used_memory"] - base["used_memory"]) / live
                ),
                "redis_session_keys_bytes": round(after["session_keys_bytes"]),
                "redis_index_bytes_per_session": round(after["index_bytes"] / live, 1),
                "sidecar_memory_bytes_per_session": round(stats["memory_bytes_used"] / live),
                "sidecar_disk_bytes_per_session": round(stats["disk_bytes_used"] / live),
                "sidecar_pinned_sessions": stats["pinned_sessions"],
                "sidecar_blocks": stats["blocks"],
                "window_s": round(window_s, 1),
                "expired_keys": int(after["expired_keys"] - before["expired_keys"]),
                "expired_stale_perc": after["stale_perc"],
                "expire_cpu_ms_per_s": round(
                    (after["expire_cpu_ms"] - before["expire_cpu_ms"]) / window_s, 2
                ),
                "sidecar_expired_sessions": int(
                    metric(sc_after, "ctxcache_sidecar_expired_sessions_total")
                    - metric(sc_before, "ctxcache_sidecar_expired_sessions_total")
                ),
                "hit_rate": round(w.cached_tokens / w.chunk_tokens, 4) if w.chunk_tokens else None,
                "errors": w.errors,
                "rss_mib": {name: round(rss_mib(pid), 1) for name, pid in stack.pids.items()},
                # CPU each process spent per operation of the mixed load: what an operation
                # costs, free of the waiting a loaded machine adds to latencies
                "cpu_ms_per_op": {name: round(v * 1000 / args.ops, 3) for name, v in cpu.items()},
                "redis_usec_per_script": round(
                    (after["script_usec"] - before["script_usec"])
                    / max(1.0, after["script_calls"] - before["script_calls"]),
                    1,
                ),
            }
            for op, values in w.latencies.items():
                row[f"{op}_n"] = len(values)
                row[f"{op}_p50_ms"] = round(percentile(values, 50) * 1000, 2)
                row[f"{op}_p99_ms"] = round(percentile(values, 99) * 1000, 2)
            row.update(filled)
            log.info("size %d: %s", size, row)
            rows.append(row)
    return rows


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples (over its labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in (" ", "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total
