"""`ctxcache bench gateway`: what the gateway adds over calling the worker directly.

One run starts its own Redis, a fast fake OpenAI backend (instant answers, so the numbers
are the gateway's own cost) and, unless --no-model, a real worker on the tiny model, with
one gateway in front of both; both backends name a real sidecar, which session turns pin.
Each case is measured direct and through the gateway, interleaved in rounds, at each
concurrency, with a minimal keep-alive load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

KEY = "bench-key"
TURNS_PER_SESSION = 20


# (full run, --quick) defaults of the options --quick shortens
QUICK = {"requests": (3000, 200), "model_requests": (200, 20), "rounds": (3, 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.util import add_output_arguments, add_tiny_model_argument

    p.add_argument("--requests", type=int, help="requests per case and round (3000; 200 --quick)")
    p.add_argument(
        "--model-requests",
        type=int,
        help="requests per case and round on the tiny model (200; 20 --quick)",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, help="interleaved rounds (3; 1 --quick)")
    p.add_argument("--no-model", action="store_true", help="only the fake backend")
    add_tiny_model_argument(p, "for the real worker")
    add_output_arguments(p, "gateway")
    p.add_argument("--quick", action="store_true", help="a short run (explicit options win)")


def main(args: argparse.Namespace) -> int:
    for name, (full, quick) in QUICK.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import httpx
    from tqdm import tqdm

    from benchmarks.loadgen import Conn, run
    from benchmarks.util import markdown_table, percentile, plot_path, run_meta, write_outputs
    from ctxcache.supervisor import Supervisor

    meta = run_meta(
        "gateway",
        requests=args.requests,
        model_requests=0 if args.no_model else args.model_requests,
        rounds=args.rounds,
        concurrency=args.concurrency,
        model=None if args.no_model else str(args.model_dir),
        turns_per_session=TURNS_PER_SESSION,
    )
    with tempfile.TemporaryDirectory() as tmp, Supervisor(out=open("/dev/null", "w")) as sup:  # noqa: ASYNC230
        sys.stderr.write("starting redis, the backends and the gateway ...\n")
        gw_port, backends = _start_stack(sup, Path(tmp), args)

        auth = {"Authorization": f"Bearer {KEY}"}
        cases: list[tuple[str, str, int, Any]] = []
        for model, port in backends.items():
            n = args.requests if model == "fake" else args.model_requests
            body = {
                "model": model,
                "prompt": "Say something about caches.",
                "max_tokens": 3,
                "temperature": 0,
            }
            cases.append((f"{model}: direct to the worker", model, n, ("direct", port, body)))
            cases.append((f"{model}: gateway, no session", model, n, ("gateway", body)))
            cases.append((f"{model}: gateway, session turn", model, n, ("session", body)))
            cases.append((f"{model}: gateway, chat session turn", model, n, ("chat", body)))

        async def new_session(model: str, kind: str) -> str:
            context = "A context of some length. " * 20
            start: dict[str, Any] = (
                {"messages": [{"role": "system", "content": context}]}
                if kind == "chat"
                else {"prompt": context}
            )
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw_port}", headers=auth) as c:
                r = await c.post("/v1/context", json={"model": model, **start})
                r.raise_for_status()
                return str(r.json()["session_id"])

        samples: dict[tuple[str, int], list[tuple[list[float], float, int]]] = {}
        total = sum(n for _, _, n, _ in cases) * args.rounds * len(args.concurrency)
        with tqdm(total=total, desc="gateway bench", unit="req") as bar:
            for conc in args.concurrency:
                for _ in range(args.rounds):
                    for name, model, n, spec in cases:
                        kind = spec[0]
                        port = spec[1] if kind == "direct" else gw_port
                        body = spec[-1]
                        # Each connection runs its own conversations, a fresh session every
                        # TURNS_PER_SESSION turns (a chat is tens of turns, not thousands).
                        slots: dict[int, list[int]] = {}  # conn -> [slot, turns so far]
                        sids: list[str] = []
                        if kind in ("session", "chat"):
                            need = conc * (n // (conc * TURNS_PER_SESSION) + 2)
                            sids = await asyncio.gather(
                                *(new_session(model, kind) for _ in range(need))
                            )
                            # each create pins its session's KV after answering: let that
                            # setup work finish before the timed turns start
                            await asyncio.sleep(1.0)

                        def make(
                            conn: Conn,
                            i: int,
                            kind: str = kind,
                            body: Any = body,
                            slots: dict[int, list[int]] = slots,
                            sids: list[str] = sids,
                            conc: int = conc,
                        ) -> bytes:
                            if kind == "direct":
                                return conn.build("POST", "/v1/completions", body)
                            if kind == "gateway":
                                return conn.build("POST", "/v1/completions", body, auth)
                            slot = slots.setdefault(id(conn), [len(slots), 0])
                            sid = sids[slot[0] + conc * (slot[1] // TURNS_PER_SESSION)]
                            slot[1] += 1
                            return conn.build("POST", *_session_turn(kind, body, sid), auth)

                        result = await run(
                            "127.0.0.1",
                            port,
                            make,
                            requests=n,
                            concurrency=conc,
                            progress=bar.update,
                        )
                        samples.setdefault((name, conc), []).append(result)

    rows, data = [], []
    for (name, conc), results in samples.items():
        lat = sorted(x for r in results for x in r[0])
        rps = sorted(len(r[0]) / r[1] for r in results)[len(results) // 2]
        errors = sum(r[2] for r in results)
        p50, p99 = percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3
        direct = next(
            (
                v
                for (n2, c2), v in samples.items()
                if c2 == conc and n2.split(":")[0] == name.split(":")[0] and "direct" in n2
            ),
            None,
        )
        over = (
            p50 - percentile(sorted(x for r in direct for x in r[0]), 50) * 1e3
            if direct and "direct" not in name
            else 0.0
        )
        rows.append([name, conc, rps, p50, p99, over, errors])
        data.append(
            {
                "case": name,
                "concurrency": conc,
                "requests_per_s": rps,
                "p50_ms": p50,
                "p99_ms": p99,
                "p50_overhead_ms": over,
                "errors": errors,
            }
        )
    table = markdown_table(
        ["case", "concurrency", "req/s", "p50 ms", "p99 ms", "p50 overhead ms", "errors"], rows
    )
    paths = write_outputs(args.out, "gateway", {"meta": meta, "results": data}, table)
    paths.append(plot_path(args, "gateway"))
    _plot(paths[-1], data, args.concurrency)
    print(table)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


def _session_turn(kind: str, body: dict[str, Any], sid: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of a session turn: a new prompt, or a new user message."""
    if kind == "chat":
        turn = {k: v for k, v in body.items() if k != "prompt"}
        turn["messages"] = [{"role": "user", "content": "And?"}]
        return "/v1/chat/completions", {**turn, "session_id": sid}
    return "/v1/completions", {**body, "prompt": " and?", "session_id": sid}


def _start_stack(sup: Any, tmp: Path, args: argparse.Namespace) -> tuple[int, dict[str, int]]:
    """Redis, the fake backend, the tiny worker (unless --no-model), a sidecar (its control
    API only: the gateway pins sessions there, as it does in production) and a gateway.

    The worker, the slowest to start, starts first and comes up while the rest do; the
    gateway is ready once its pool lists every backend's model. Returns (gateway port,
    {model: backend port}).
    """
    import time

    import httpx

    from ctxcache.net import free_port
    from ctxcache.redis_server import RedisServer
    from ctxcache.supervisor import Child, http_ready

    backends: dict[str, int] = {}
    worker: Child | None = None
    if not args.no_model:
        if not (args.model_dir / "config.json").exists():
            from worker.presets.model import create_model

            create_model("tiny", args.model_dir)
        backends["tiny"] = free_port()
        cmd = ["worker", "--model", str(args.model_dir), "--model-name", "tiny"]
        argv = [sys.executable, "-m", "ctxcache.cli", *cmd, "--port", str(backends["tiny"])]
        worker = sup.start(Child("worker", argv))  # readiness checked below
    redis = RedisServer(tmp / "redis")
    redis.data_dir.mkdir(parents=True)
    sup.start(Child("redis", redis.argv(), ready=redis.wait_ready))
    backends["fake"] = free_port()
    argv = [sys.executable, "-m", "benchmarks.fake_worker", "--port", str(backends["fake"])]
    ready = http_ready(f"http://127.0.0.1:{backends['fake']}/health")
    sup.start(Child("fake", argv, ready=ready))
    # a real sidecar's control API, as in production: session turns pin their KV there
    sidecar = free_port()
    argv = [sys.executable, "-m", "ctxcache.cli", "sidecar", "--port", str(free_port())]
    argv += ["--control-port", str(sidecar), "--log-level", "WARNING"]
    sup.start(Child("sidecar", argv, ready=http_ready(f"http://127.0.0.1:{sidecar}/health")))
    gw_port = free_port()
    argv = [sys.executable, "-m", "ctxcache.cli", "gateway", "--port", str(gw_port)]
    argv += ["--redis-url", redis.url, "--api-key", f"{KEY}=bench", "--log-level", "WARNING"]
    for port in backends.values():
        argv += ["--worker", f"http://127.0.0.1:{port}=http://127.0.0.1:{sidecar}"]
    sup.start(Child("gateway", argv, ready=http_ready(f"http://127.0.0.1:{gw_port}/ready")))
    deadline = time.monotonic() + 180
    while True:
        r = httpx.get(f"http://127.0.0.1:{gw_port}/v1/models", timeout=5)
        if {m["id"] for m in r.json()["data"]} >= backends.keys():
            break
        if worker is not None and worker.proc is not None and worker.proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {worker.proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway does not list {sorted(backends)} after 180 s")
        time.sleep(0.2)
    return gw_port, {"fake": backends["fake"], **backends}


def _plot(path: Path, data: list[dict[str, Any]], concurrency: list[int]) -> None:
    from benchmarks.util import bar_plot

    labels = [d["case"] for d in data if d["concurrency"] == concurrency[0]]
    series = {
        f"concurrency {c}": [d["requests_per_s"] for d in data if d["concurrency"] == c]
        for c in concurrency
    }
    bar_plot(path, "gateway vs direct: requests/s", labels, series, "requests / s")
