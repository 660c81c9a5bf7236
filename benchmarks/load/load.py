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

Here: the options, the run and its checks. The stack and what is observed of it are in
`benchmarks.load.load_stack`, a session's requests and the history check in
`benchmarks.load.load_driver`, the outputs in `benchmarks.load.load_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.load.load_driver import Load, TurnResult
from benchmarks.load.load_stack import KEY, Sampler, Stack, own_stack, same_as, snapshot

# (full run, --quick) per backend: sessions, turns
SIZES = {"fake": ((200, 5), (40, 3)), "tiny": ((20, 5), (4, 2))}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments, add_tiny_model_argument

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
        own_stack(args, Path(tmp), logs) as stack,
    ):
        return asyncio.run(_bench(args, stack))


async def _bench(args: argparse.Namespace, stack: Stack) -> int:
    from tqdm import tqdm

    from benchmarks.lib.util import percentile

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
    from benchmarks.load.load_report import report

    return report(args, row, sampler.rows, by_index)


def _sidecar_bytes(snap: dict[str, Any]) -> int | None:
    sc = snap.get("sidecar")
    return sc["memory_bytes_used"] + sc["disk_bytes_used"] if sc else None
