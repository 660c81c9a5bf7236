"""`ctxcache bench gateway`: what the gateway adds over calling the worker directly.

One run starts its own Redis, a fast fake OpenAI backend (instant answers, so the numbers
are the gateway's own cost) and, unless --no-model, a real worker on the tiny model, with
one gateway in front of both; both backends name a real sidecar, which session turns pin.
Each case is measured direct and through the gateway, interleaved in rounds, at each
concurrency. Plain and streaming requests are measured with `wrk` where it is installed
(`benchmarks.wrk`), otherwise with our own keep-alive generator (`benchmarks.loadgen`),
which also runs the session turns (a conversation per connection) and the streams' TTFT.

Where the processes run: with --pin (the default on two CPUs or more) the cases at
concurrency 1 run with the gateway alone on the last CPU and every other process (load
generator, fake backend, Redis, sidecar; not the tiny model's worker, whose threads keep
every CPU) on the first, as a gateway and its workers sit on different hosts. At
concurrency 1 only one process works at a time, so pinning adds no CPU to either side;
cases at higher concurrency always run unpinned, where a CPU of its own would give the
gateway capacity that direct calls do not get. Pinned or not, one run's ratios move on a
small VM by more than a small change to the gateway does (docs/benchmarks.md, "Fifth
pass"): to compare two gateways, use `ctxcache bench gateway-ab`.

--tracing adds a second gateway with OpenTelemetry on (`OTEL_EXPORTER_OTLP_ENDPOINT` at a
local OTLP receiver, `benchmarks.otlp_sink`, in a process of its own) and measures its plain
requests and session turns in the same rounds: tracing on against off, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gateway_report import Sample

KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TURNS_PER_SESSION = 20


# (full run, --quick) defaults of the options --quick shortens
QUICK = {"requests": (3000, 200), "model_requests": (200, 20), "rounds": (3, 1), "duration": (5, 1)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benchmarks.util import add_output_arguments, add_pin_argument, add_tiny_model_argument

    p.add_argument(
        "--requests",
        type=int,
        help="our generator: requests per case and round (3000; 200 --quick)",
    )
    p.add_argument(
        "--model-requests",
        type=int,
        help="our generator: requests per case and round on the tiny model (200; 20 --quick)",
    )
    p.add_argument("--duration", type=float, help="wrk: seconds per case and round (5; 1 --quick)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument(
        "--stream-concurrency",
        type=int,
        nargs="+",
        default=[8],
        help="concurrency of the streaming cases (their TTFT is measured at 1)",
    )
    p.add_argument(
        "--stream-tokens", type=int, default=16, help="tokens (= chunks) per streamed answer"
    )
    p.add_argument(
        "--generator",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="plain and streaming cases: wrk, our generator, or wrk when installed (auto)",
    )
    p.add_argument("--rounds", type=int, help="interleaved rounds (3; 1 --quick)")
    p.add_argument("--no-model", action="store_true", help="only the fake backend")
    p.add_argument(
        "--floor",
        action="store_true",
        help="also the streaming TTFT of a bare ASGI relay on the gateway's own server and "
        "worker client (benchmarks.bare_relay): what the app's layers add",
    )
    add_pin_argument(
        p, "concurrency-1 cases: the gateway on the last CPU, every other process on the first"
    )
    p.add_argument(
        "--gateway-tree",
        type=Path,
        help="start the gateway from this checkout instead (another commit's gateway, "
        "measured by this bench)",
    )
    p.add_argument(
        "--tracing",
        action="store_true",
        help="also a gateway with tracing on (spans exported to a local OTLP receiver)",
    )
    add_tiny_model_argument(p, "for the real worker")
    add_output_arguments(p, "gateway")
    p.add_argument("--quick", action="store_true", help="a short run (explicit options win)")


def main(args: argparse.Namespace) -> int:
    for name, (full, quick) in QUICK.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return asyncio.run(_run(args))


@dataclass
class Case:
    name: str
    model: str
    path: str
    body: dict[str, Any]
    concurrency: list[int]
    requests: int
    direct: bool = False
    session: str | None = None  # a session turn: "completion" or "chat"
    ttft: bool = False  # measured by our generator, for the time to the first chunk
    traced: bool = False  # through the gateway with tracing on (--tracing)
    bare: bool = False  # through the bare ASGI relay (--floor)

    @property
    def wrk_able(self) -> bool:
        return self.session is None and not self.ttft


def _cases(args: argparse.Namespace, backends: dict[str, int]) -> tuple[list[Case], dict[str, str]]:
    """The cases, in the order each round runs them; and each case's direct case."""
    cases: list[Case] = []
    direct_of: dict[str, str] = {}
    for model in backends:
        n = args.requests if model == "fake" else args.model_requests
        body = {"model": model, "prompt": "Say something about caches.", "max_tokens": 3}
        body["temperature"] = 0
        plain = [
            Case(f"{model}: direct to the worker", model, "/v1/completions", body, [], n, True),
            Case(f"{model}: gateway, no session", model, "/v1/completions", body, [], n),
            Case(f"{model}: gateway, session turn", model, "", body, [], n, session="completion"),
            Case(f"{model}: gateway, chat session turn", model, "", body, [], n, session="chat"),
        ]
        if args.tracing:
            plain += [
                Case(f"{model}: traced gateway, no session", model, "/v1/completions", body, [], n),
                Case(f"{model}: traced gateway, session turn", model, "", body, [], n),
            ]
            plain[-2].traced = True
            plain[-1].traced, plain[-1].session = True, "completion"
        for case in plain:
            case.concurrency = args.concurrency
            direct_of[case.name] = plain[0].name
        cases += plain
        if model != "fake":
            continue
        chat = streamed_chat(model, args.stream_tokens)
        path = "/v1/chat/completions"
        for label, conc, ttft in (
            ("streaming chat", args.stream_concurrency, False),
            ("streaming chat TTFT", [1], True),
        ):
            pair = [
                Case(f"{model}: {label}, direct", model, path, chat, conc, n, True, ttft=ttft),
                Case(f"{model}: {label}, gateway", model, path, chat, conc, n, ttft=ttft),
            ]
            if ttft and args.floor:
                name = f"{model}: {label}, bare ASGI relay"
                pair.append(Case(name, model, path, chat, conc, n, ttft=ttft, bare=True))
            direct_of.update({c.name: pair[0].name for c in pair})
            cases += pair
    return cases, direct_of


async def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from benchmarks import gateway_report, wrk
    from benchmarks.util import plot_path, run_meta, write_outputs
    from ctxcache.supervisor import Supervisor

    wrk_path = wrk.find() if args.generator != "python" else None
    if args.generator == "wrk" and wrk_path is None:
        sys.stderr.write("--generator wrk: wrk is not installed (apt-get install wrk)\n")
        return 2
    generator = (
        f"wrk ({wrk_path}) for plain and streaming requests; ours for session turns and TTFT"
        if wrk_path
        else "ours (benchmarks.loadgen) for every case"
        + ("" if args.generator == "python" else ": wrk is not installed")
    )
    sys.stderr.write(f"load generator: {generator}\n")
    meta = run_meta(
        "gateway",
        generator=generator,
        requests=args.requests,
        model_requests=0 if args.no_model else args.model_requests,
        wrk_seconds=args.duration if wrk_path else None,
        rounds=args.rounds,
        concurrency=args.concurrency,
        stream_concurrency=args.stream_concurrency,
        stream_tokens=args.stream_tokens,
        model=None if args.no_model else str(args.model_dir),
        turns_per_session=TURNS_PER_SESSION,
        tracing="a second gateway with OTLP export to a local receiver" if args.tracing else None,
        pinned="concurrency 1: the gateway on the last CPU, the rest on the first"
        if args.pin
        else None,
        gateway_tree=str(args.gateway_tree.resolve()) if args.gateway_tree else None,
    )
    samples: dict[tuple[str, int], list[Sample]] = {}
    with tempfile.TemporaryDirectory() as tmp, Supervisor(out=open("/dev/null", "w")) as sup:  # noqa: ASYNC230
        sys.stderr.write("starting redis, the backends and the gateway ...\n")
        gw_port, backends, traced_port = _start_stack(sup, Path(tmp), args)
        bare_port = _start_bare_relay(sup, backends["fake"]) if args.floor else None
        cases, direct_of = _cases(args, backends)
        plan = [
            (conc, case)
            for conc in sorted({c for case in cases for c in case.concurrency})
            for _ in range(args.rounds)
            for case in cases
            if conc in case.concurrency
        ]
        placement = Placement(sup)
        with tqdm(total=len(plan), desc="gateway bench", unit="case") as bar:
            for conc, case in plan:
                placement.set(pinned=args.pin and conc == 1)
                gateway = traced_port if case.traced else gw_port
                port = backends[case.model] if case.direct else gateway
                if case.bare:
                    assert bare_port is not None
                    port = bare_port
                if wrk_path and case.wrk_able:
                    sample = await _measure_wrk(wrk_path, port, case, conc, args.duration)
                else:
                    sample = await measure_ours(port, gateway, case, conc)
                samples.setdefault((case.name, conc), []).append(sample)
                bar.update(1)

    data = gateway_report.rows(samples, direct_of)
    table = gateway_report.table(data)
    paths = write_outputs(args.out, "gateway", {"meta": meta, "results": data}, table)
    paths.append(plot_path(args, "gateway"))
    gateway_report.plot(paths[-1], data)
    print(f"load generator: {generator}\n")
    print(table)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


GATEWAYS = {"gateway", "traced-gateway", "bare-relay"}  # the children --pin sets apart
# the tiny model's worker computes on threads of its own (torch): squeezed onto one CPU
# with the generator they would wait on each other, so it keeps every CPU
FLOATING = {"worker"}


class Placement:
    """Which CPUs the bench's processes run on: pinned (the children named in `apart` on
    the last CPU; every other child but the tiny model's worker, and this process, on the
    first) or every CPU for everyone. wrk, started per case, inherits this process's CPUs."""

    def __init__(self, sup: Any, apart: set[str] = GATEWAYS) -> None:
        self.sup = sup
        self.apart = apart
        self.cpus = os.sched_getaffinity(0)
        self.pinned: bool | None = None

    def set(self, *, pinned: bool) -> None:
        from benchmarks.util import pin

        if pinned == self.pinned:
            return
        first, last = {min(self.cpus)}, {max(self.cpus)}
        for child in self.sup.children:
            if child.proc is not None and child.proc.poll() is None:
                if child.name in FLOATING:
                    continue
                apart = child.name in self.apart
                pin(child.proc.pid, (last if apart else first) if pinned else self.cpus)
        pin(os.getpid(), first if pinned else self.cpus)
        self.pinned = pinned


async def _measure_wrk(wrk_path: str, port: int, case: Case, conc: int, seconds: float) -> Sample:
    import orjson

    from benchmarks import wrk

    headers = {} if case.direct else AUTH
    url = f"http://127.0.0.1:{port}{case.path}"
    r = await wrk.run(
        wrk_path, url, orjson.dumps(case.body), headers, connections=conc, seconds=seconds
    )
    return Sample(r.requests_per_s, r.p50_ms, r.p99_ms, None, r.errors, "wrk")


async def measure_ours(port: int, gw_port: int, case: Case, conc: int) -> Sample:
    import httpx

    from benchmarks.loadgen import Conn, run
    from benchmarks.util import percentile

    async def new_session() -> str:
        context = "A context of some length. " * 20
        start: dict[str, Any] = (
            {"messages": [{"role": "system", "content": context}]}
            if case.session == "chat"
            else {"prompt": context}
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw_port}", headers=AUTH) as c:
            r = await c.post("/v1/context", json={"model": case.model, **start})
            r.raise_for_status()
            return str(r.json()["session_id"])

    # Each connection runs its own conversations, a fresh session every TURNS_PER_SESSION
    # turns (a chat is tens of turns, not thousands).
    slots: dict[int, list[int]] = {}  # conn -> [slot, turns so far]
    sids: list[str] = []
    if case.session is not None:
        need = conc * (case.requests // (conc * TURNS_PER_SESSION) + 2)
        sids = await asyncio.gather(*(new_session() for _ in range(need)))
        # each create pins its session's KV after answering: let that setup work finish
        # before the timed turns start
        await asyncio.sleep(1.0)

    def make(conn: Conn, i: int) -> bytes:
        if case.session is None:
            return conn.build("POST", case.path, case.body, None if case.direct else AUTH)
        slot = slots.setdefault(id(conn), [len(slots), 0])
        sid = sids[slot[0] + conc * (slot[1] // TURNS_PER_SESSION)]
        slot[1] += 1
        return conn.build("POST", *_session_turn(case.session, case.body, sid), AUTH)

    r = await run("127.0.0.1", port, make, requests=case.requests, concurrency=conc)
    lat = sorted(r.latencies)
    ttft = percentile(sorted(r.ttfts), 50) * 1e3 if case.ttft else None
    return Sample(
        len(lat) / r.seconds,
        percentile(lat, 50) * 1e3,
        percentile(lat, 99) * 1e3,
        ttft,
        r.errors,
        "ours",
    )


def streamed_chat(model: str, tokens: int) -> dict[str, Any]:
    """The streaming cases' request: a short chat question, `tokens` tokens (= chunks)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Say something about caches."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }


def _start_bare_relay(sup: Any, backend: int) -> int:
    from ctxcache.net import free_port
    from ctxcache.supervisor import Child, http_ready

    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.bare_relay", "--port", str(port)]
    argv += ["--worker", f"http://127.0.0.1:{backend}"]
    sup.start(Child("bare-relay", argv, ready=http_ready(f"http://127.0.0.1:{port}/health")))
    return port


def _session_turn(kind: str, body: dict[str, Any], sid: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of a session turn: a new prompt, or a new user message."""
    if kind == "chat":
        turn = {k: v for k, v in body.items() if k != "prompt"}
        turn["messages"] = [{"role": "user", "content": "And?"}]
        return "/v1/chat/completions", {**turn, "session_id": sid}
    return "/v1/completions", {**body, "prompt": " and?", "session_id": sid}


def _start_stack(
    sup: Any, tmp: Path, args: argparse.Namespace
) -> tuple[int, dict[str, int], int | None]:
    """Redis, the fake backend, the tiny worker (unless --no-model), a sidecar (its control
    API only: the gateway pins sessions there, as it does in production) and a gateway
    (--tracing: and a traced one, with its OTLP receiver).

    The worker, the slowest to start, starts first and comes up while the rest do; the
    gateway is ready once its pool lists every backend's model. Returns (gateway port,
    {model: backend port}, the traced gateway's port or None).
    """
    import time

    import httpx

    from ctxcache import tracing
    from ctxcache.net import free_port
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
    redis = start_redis(sup, tmp)
    backends["fake"] = start_fake_worker(sup)
    sidecar = start_sidecar(sup)

    def gateway(name: str, env: dict[str, str]) -> int:
        urls = [f"http://127.0.0.1:{backend}" for backend in backends.values()]
        return start_gateway(sup, name, redis, urls, sidecar, tree=args.gateway_tree, env=env)

    ports = [gateway("gateway", {tracing.ENDPOINT_ENV: ""})]  # off, whatever the shell says
    traced_port = None
    if args.tracing:
        sink = free_port()
        argv = [sys.executable, "-m", "benchmarks.otlp_sink", "--port", str(sink)]
        sup.start(Child("otlp-sink", argv, ready=http_ready(f"http://127.0.0.1:{sink}/health")))
        traced_port = gateway("traced-gateway", {tracing.ENDPOINT_ENV: f"http://127.0.0.1:{sink}"})
        ports.append(traced_port)
    deadline = time.monotonic() + 180
    for gw_port in ports:
        while True:
            r = httpx.get(f"http://127.0.0.1:{gw_port}/v1/models", timeout=5)
            if {m["id"] for m in r.json()["data"]} >= backends.keys():
                break
            if worker is not None and worker.proc is not None and worker.proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {worker.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway does not list {sorted(backends)} after 180 s")
            time.sleep(0.2)
    return ports[0], {"fake": backends["fake"], **backends}, traced_port


def start_redis(sup: Any, tmp: Path) -> str:
    """A Redis of the bench's own, under `tmp`: its URL."""
    from ctxcache.redis_server import RedisServer
    from ctxcache.supervisor import Child

    redis = RedisServer(tmp / "redis")
    redis.data_dir.mkdir(parents=True)
    sup.start(Child("redis", redis.argv(), ready=redis.wait_ready))
    return redis.url


def start_fake_worker(sup: Any) -> int:
    """The fast fake backend (`benchmarks.fake_worker`): its port."""
    from ctxcache.net import free_port
    from ctxcache.supervisor import Child, http_ready

    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.fake_worker", "--port", str(port)]
    sup.start(Child("fake", argv, ready=http_ready(f"http://127.0.0.1:{port}/health")))
    return port


def start_sidecar(sup: Any) -> int:
    """A real sidecar, as in production (session turns pin their KV there): its control
    port."""
    from ctxcache.net import free_port
    from ctxcache.supervisor import Child, http_ready

    control = free_port()
    argv = [sys.executable, "-m", "ctxcache.cli", "sidecar", "--port", str(free_port())]
    argv += ["--control-port", str(control), "--log-level", "WARNING"]
    sup.start(Child("sidecar", argv, ready=http_ready(f"http://127.0.0.1:{control}/health")))
    return control


def start_gateway(
    sup: Any,
    name: str,
    redis_url: str,
    workers: list[str],
    sidecar: int,
    *,
    tree: Path | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """A gateway (`tree`: started from that checkout) with the bench's key, in front of
    `workers`, each storing into `sidecar`; ready once `/ready` says so. Its port."""
    from ctxcache.net import free_port
    from ctxcache.supervisor import Child, http_ready

    port = free_port()
    argv = [sys.executable, "-m", "ctxcache.cli", "gateway", "--port", str(port)]
    env = dict(env or {})
    if tree is not None:  # -P: the checkout on PYTHONPATH, not the working directory
        argv[1:1] = ["-P"]
        env["PYTHONPATH"] = str(tree.resolve())
    argv += ["--redis-url", redis_url, "--api-key", f"{KEY}=bench", "--log-level", "WARNING"]
    for url in workers:
        argv += ["--worker", f"{url}=http://127.0.0.1:{sidecar}"]
    sup.start(Child(name, argv, ready=http_ready(f"http://127.0.0.1:{port}/ready"), env=env))
    return port
