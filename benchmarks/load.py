"""`ctxcache bench load`: many concurrent sessions through the whole stack, then checks.

By default one run starts its own stack: a Redis, a KV sidecar, backend workers (`--backend
fake`: the instant fake of the worker contract, so the load is on the gateway, manager and
Redis; `--backend tiny`: real CPU workers on the tiny model, storing KV in the sidecar) and a
gateway with an API key. Every session is created, then runs `--turns` chat turns (streamed
and not, alternately), all sessions at once up to `--concurrency`. Afterwards:

- every session's history (GET /v1/context/{id}) has exactly the turns and tokens the client
  was answered with: no turn lost, none duplicated, none appended onto a stale history;
- half the sessions are deleted, the other half get a short ttl and expire; all must answer
  404, and the Redis keys and the sidecar's blocks, bytes and pins must return to the baseline
  taken before the run (within `--deadline`);
- gateway and worker RSS are sampled throughout; the gateway's growth must stay under
  `--max-rss-growth-mib`.

Statuses other than 2xx: 409 `session_busy`, 429 and 503 are documented answers under load;
they are counted and the turn is retried after `retry-after-ms` (the OpenAI SDKs retry 409,
429 and 5xx by default, so a well-behaved client does too). A session turn is sent by one
client at a time, so a 409 only comes from `--race-every`: every Nth session sends one turn
twice at once, and exactly one of the pair must wait for the other. Any other status, a
failed check or a missed deadline makes the exit code non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import orjson

log = logging.getLogger("ctxcache.bench.load")

KEY = "load-key"
TENANT = "load"
RETRY = (409, 429, 503)
LONG_TTL = 3600
WORDS = ["cache", "token", "session", "prefix", "history", "worker", "block", "chunk"]

# (full run, --quick) per backend: sessions, turns
SIZES = {"fake": ((200, 5), (40, 3)), "tiny": ((20, 5), (4, 2))}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.util import add_output_arguments, add_tiny_model_argument

    p.add_argument("--backend", choices=("fake", "tiny"), default="fake")
    p.add_argument(
        "--redis",
        choices=("single", "cluster", "both"),
        default="single",
        help="the stack's session store: one redis-server, a 3-master / 3-replica Redis "
        "Cluster, or both one after the other (outputs under OUT/single and OUT/cluster)",
    )
    p.add_argument("--sessions", type=int, help="sessions (fake 200, tiny 20; --quick 40, 4)")
    p.add_argument("--turns", type=int, help="chat turns per session after the create (5)")
    p.add_argument("--concurrency", type=int, default=0, help="sessions at once (0: all)")
    p.add_argument("--workers", type=int, default=0, help="backend workers (0: fake 2, tiny 1)")
    p.add_argument("--context-words", type=int, default=0, help="0: fake 200, tiny 320")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens generated per turn")
    p.add_argument("--race-every", type=int, default=10, help="every Nth session races a turn")
    p.add_argument("--max-retries", type=int, default=50, help="per turn, on 409/429/503")
    p.add_argument("--expire-ttl", type=int, default=2, help="ttl of the sessions left to expire")
    p.add_argument("--deadline", type=float, default=120.0, help="seconds to return to baseline")
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0, help="of the gateway")
    add_tiny_model_argument(p, "of the tiny workers")
    add_output_arguments(p, "load")
    p.add_argument("--quick", action="store_true", help="a short run (explicit options win)")
    p.add_argument("--gateway", default=None, help="load a running gateway, start no stack")
    p.add_argument("--api-key", default=KEY, help="with --gateway")
    p.add_argument("--model-name", default=None, help="with --gateway (default: its first)")
    p.add_argument("--redis-url", default=None, help="with --gateway: check this Redis's keys")
    p.add_argument("--sidecar-control", default=None, help="with --gateway: check its stats")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    from ctxcache.logs import setup_logging

    setup_logging("bench")
    full, quick = SIZES[args.backend]
    sessions, turns = quick if args.quick else full
    args.sessions = args.sessions or sessions
    args.turns = args.turns or turns
    args.concurrency = args.concurrency or args.sessions
    args.workers = args.workers or (2 if args.backend == "fake" else 1)
    args.context_words = args.context_words or (200 if args.backend == "fake" else 320)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.gateway:
        args.redis = "external"
        stack = Stack(
            args.gateway, args.api_key, args.model_name or "", args.redis_url, args.sidecar_control
        )
        return asyncio.run(_bench(args, stack))
    if args.redis != "both":
        return _run_own(args)
    worst = 0
    for topology in ("single", "cluster"):  # the same workload on each, back to back
        one = argparse.Namespace(**{**vars(args), "redis": topology, "out": args.out / topology})
        if args.plot:
            one.plot = Path(args.plot).with_stem(f"{Path(args.plot).stem}-{topology}")
        one.out.mkdir(parents=True, exist_ok=True)
        worst = max(worst, _run_own(one))
    return worst


def _run_own(args: argparse.Namespace) -> int:
    with (
        (args.out / "load-stack.log").open("w") as logs,
        tempfile.TemporaryDirectory() as tmp,
        _own_stack(args, Path(tmp), logs) as stack,
    ):
        return asyncio.run(_bench(args, stack))


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
def _own_stack(args: argparse.Namespace, tmp: Path, logs: IO[str]) -> Iterator[Stack]:
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
def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


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


# -- the load ---------------------------------------------------------------------------------
@dataclass
class TurnResult:
    prompt_tokens: int
    completion_tokens: int
    context_tokens: int  # the session's, after this turn
    seconds: float
    index: int


@dataclass
class Load:
    args: argparse.Namespace
    client: httpx.AsyncClient
    model: str
    sampler: Sampler
    statuses: Counter[int | str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    retried: int = 0

    def fail(self, what: str) -> None:
        self.failures.append(what)
        if len(self.failures) <= 10:
            log.error("%s", what)

    async def call(self, method: str, url: str, body: Any = None, stream: bool = False) -> Any:
        """One request with the documented retries; the JSON answer (or the final usage
        chunk's, when streaming), or None after an unexpected status."""
        for attempt in range(self.args.max_retries + 1):
            self.sampler.inflight += 1
            try:
                status, payload, headers = await self._send(method, url, body, stream)
            except httpx.TransportError as exc:  # not retried: a turn may have committed
                self.statuses[f"{type(exc).__name__}"] += 1
                self.fail(f"{method} {url}: {type(exc).__name__} {exc}")
                return None
            finally:
                self.sampler.inflight -= 1
            error = payload.get("error") if isinstance(payload, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
            self.statuses[f"{status} {code}" if code else status] += 1
            if status < 400:
                return payload
            if status not in RETRY or attempt == self.args.max_retries:
                self.fail(f"{method} {url}: {status} {str(payload)[:200]}")
                return None
            self.retried += 1
            wait_ms = int(headers.get("retry-after-ms") or 0) or 50 * 2 ** min(attempt, 5)
            await asyncio.sleep(min(wait_ms, 2000) / 1000 * random.uniform(0.5, 1.0))
        return None

    async def _send(
        self, method: str, url: str, body: Any, stream: bool
    ) -> tuple[int, Any, httpx.Headers]:
        if not stream:
            r = await self.client.request(method, url, json=body)
            return r.status_code, _json(r), r.headers
        async with self.client.stream(method, url, json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                return r.status_code, _json(r), r.headers
            last: dict[str, Any] = {}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = orjson.loads(line[6:])
                    if event.get("usage"):
                        last = event
            return r.status_code, last, r.headers

    async def turn(self, sid: str, i: int, k: int, salt: str = "") -> TurnResult | None:
        stream = (i + k) % 2 == 1
        body: dict[str, Any] = {
            "model": self.model,
            "session_id": sid,
            "messages": [{"role": "user", "content": f"Turn {k}{salt} of session {i}: and?"}],
            "max_tokens": self.args.max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        out = await self.call("POST", "/v1/chat/completions", body, stream=stream)
        if out is None:
            return None
        usage, session = out.get("usage") or {}, out.get("session") or {}
        if "context_tokens" not in session or "prompt_tokens" not in usage:
            self.fail(f"session {sid} turn {k}: no usage/session in the answer: {out}")
            return None
        return TurnResult(
            usage["prompt_tokens"],
            usage["completion_tokens"],
            session["context_tokens"],
            time.perf_counter() - t0,
            k,
        )

    async def session(self, i: int, bar: Any) -> tuple[str, int, list[TurnResult]] | None:
        rng = random.Random(i)
        text = " ".join(rng.choice(WORDS) for _ in range(self.args.context_words))
        create = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": f"You are load test session {i}."},
                {"role": "user", "content": text},
            ],
            "ttl": LONG_TTL,
            "max_tokens": 0,
        }
        out = await self.call("POST", "/v1/context", create)
        bar.update(1)
        if out is None:
            return None
        sid, ctx0 = out["session_id"], out["session"]["context_tokens"]
        results: list[TurnResult] = []
        for k in range(1, self.args.turns + 1):
            race = k == 1 and self.args.race_every and i % self.args.race_every == 0
            if race:  # one client sends the same turn twice at once: one must wait (409)
                pair = await asyncio.gather(self.turn(sid, i, k), self.turn(sid, i, k, "b"))
                results += [r for r in pair if r is not None]
            else:
                r = await self.turn(sid, i, k)
                results += [r] if r is not None else []
            bar.update(1)
        return sid, ctx0, results

    async def check_history(self, sid: str, ctx0: int, results: list[TurnResult]) -> None:
        """The stored session is exactly what the client was answered: turns, tokens, chain."""
        info = await self.call("GET", f"/v1/context/{sid}")
        if info is None:
            return
        for problem in history_problems(ctx0, results, info["turns"], info["context_tokens"]):
            self.fail(f"session {sid}: {problem}")


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text or None


def history_problems(
    ctx0: int, results: list[TurnResult], stored_turns: int, stored_tokens: int
) -> list[str]:
    """What is wrong with a stored session, given what the client was answered.

    Ordered by the context size each answer reported, every turn must have been prompted
    with the whole context before it (prompt > previous context: nothing lost, not built on
    a stale history) and have left exactly prompt + completion tokens; the stored session
    must hold the create plus one turn per answered turn (none lost, none duplicated) and
    the last answer's context size.
    """
    problems: list[str] = []
    before = ctx0
    for r in sorted(results, key=lambda r: r.context_tokens):
        if r.context_tokens != r.prompt_tokens + r.completion_tokens or r.prompt_tokens <= before:
            problems.append(
                f"turn {r.index} not built on the previous one (context before {before}, "
                f"prompt {r.prompt_tokens}, completion {r.completion_tokens}, "
                f"after {r.context_tokens})"
            )
        before = r.context_tokens
    if (stored_turns, stored_tokens) != (1 + len(results), before):
        problems.append(
            f"stored {stored_turns} turns / {stored_tokens} tokens, the client was answered "
            f"{1 + len(results)} / {before}"
        )
    return problems


async def _bench(args: argparse.Namespace, stack: Stack) -> int:
    from tqdm import tqdm

    from benchmarks.util import percentile

    headers = {"Authorization": f"Bearer {stack.api_key}"}
    # idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them, so
    # a request never goes out on a connection the server is closing at that moment
    limits = httpx.Limits(
        max_connections=args.concurrency + 8, max_keepalive_connections=None, keepalive_expiry=2.0
    )
    async with httpx.AsyncClient(
        base_url=stack.gateway, headers=headers, timeout=600, limits=limits
    ) as client:
        if not stack.model:
            stack.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        baseline = await snapshot(stack)
        sampler = Sampler(stack.pids)
        sampling = asyncio.create_task(sampler.run())
        load = Load(args, client, stack.model, sampler)
        gate = asyncio.Semaphore(args.concurrency)

        async def one(i: int) -> tuple[str, int, list[TurnResult]] | None:
            async with gate:
                return await load.session(i, bar)

        total = args.sessions * (args.turns + 1)
        with tqdm(total=total, desc=f"load ({args.backend})", disable=args.no_progress) as bar:
            t0 = time.perf_counter()
            done = await asyncio.gather(*(one(i) for i in range(args.sessions)))
            load_s = time.perf_counter() - t0
        sessions = [s for s in done if s is not None]
        loaded = await snapshot(stack)
        await asyncio.gather(*(load.check_history(*s) for s in sessions))

        # half deleted, half left to expire (a short ttl now: no turn could expire mid-run)
        deleted, expiring = sessions[0::2], sessions[1::2]
        await asyncio.gather(*(load.call("DELETE", f"/v1/context/{s[0]}") for s in deleted))
        for s in expiring:
            await load.call("PATCH", f"/v1/context/{s[0]}", {"ttl": args.expire_ttl})
        t_end = time.perf_counter()
        deadline = time.monotonic() + args.deadline
        gone = 0
        for sid, _, _ in sessions:
            while True:
                r = await client.get(f"/v1/context/{sid}")
                if r.status_code == 404 and r.json()["error"]["code"] == "session_not_found":
                    gone += 1
                    break
                if time.monotonic() > deadline:
                    load.fail(f"session {sid} still answers {r.status_code} after the deadline")
                    break
                await asyncio.sleep(0.25)
        after = await snapshot(stack)
        while not same_as(baseline, after) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            after = await snapshot(stack)
        back_s = time.perf_counter() - t_end
        sampler.sample()
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling

    snaps = {"before": baseline, "loaded": loaded, "after": after}
    if not same_as(baseline, after):
        extra = sorted(set(after.get("redis_keys", [])) - set(baseline.get("redis_keys", [])))
        load.fail(
            f"not back to baseline after {args.deadline}s: redis keys {extra[:10]} "
            f"({len(extra)} extra), sidecar {after.get('sidecar')} vs "
            f"{baseline.get('sidecar')}"
        )
    rss = sampler.summary() if sampler.rows and stack.pids else {}
    if "gateway" in rss:
        growth = rss["gateway"]["peak"] - rss["gateway"]["start"]
        if growth > args.max_rss_growth_mib:
            load.fail(f"gateway RSS grew {growth:.0f} MiB (> {args.max_rss_growth_mib})")
    turns = [r for _, _, rs in sessions for r in rs]
    racing = sum(1 for i in range(args.sessions) if args.race_every and i % args.race_every == 0)
    expected = args.sessions * args.turns + (racing if args.turns else 0)
    if len(turns) != expected:
        load.fail(f"{len(turns)} turns answered, {expected} expected")
    lat = [r.seconds * 1e3 for r in turns]
    by_index = {
        k: [r.seconds * 1e3 for r in turns if r.index == k] for k in range(1, args.turns + 1)
    }
    row = {
        "backend": args.backend,
        "redis": getattr(args, "redis", "external"),
        "sessions": args.sessions,
        "turns_per_session": args.turns,
        "concurrency": args.concurrency,
        "workers": args.workers,
        "statuses": {
            str(k): v for k, v in sorted(load.statuses.items(), key=lambda kv: str(kv[0]))
        },
        "retried": load.retried,
        "sessions_ok": len(sessions),
        "turns_ok": len(turns),
        "turns_expected": expected,
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "p50_ms_by_turn": {str(k): percentile(v, 50) for k, v in by_index.items()},
        "p99_ms_by_turn": {str(k): percentile(v, 99) for k, v in by_index.items()},
        "load_seconds": load_s,
        "turns_per_s": len(turns) / load_s if load_s else 0.0,
        "sessions_gone": gone,
        "back_to_baseline_s": back_s,
        "rss_mib": rss,
        "redis_keys": {k: len(v.get("redis_keys", [])) for k, v in snaps.items()},
        "sidecar_bytes": {k: _sidecar_bytes(v) for k, v in snaps.items()},
        "sidecar": {k: v.get("sidecar") for k, v in snaps.items()},
        "failures": load.failures[:50],
        "ok": not load.failures,
    }
    from benchmarks.load_report import report

    return report(args, row, sampler.rows, by_index)


def _sidecar_bytes(snap: dict[str, Any]) -> int | None:
    sc = snap.get("sidecar")
    return sc["memory_bytes_used"] + sc["disk_bytes_used"] if sc else None
