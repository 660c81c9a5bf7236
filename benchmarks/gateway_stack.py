"""The processes `ctxcache bench gateway` runs, and where they run: Redis, the fake backend,
the tiny model's worker, a sidecar and the gateways (`start_stack`), the bare ASGI relay of
--floor, and the CPUs of each (`Placement`, --pin). `ctxcache bench gateway-ab` starts its
own stack from the same parts. See benchmarks/gateway.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

KEY = "bench-key"  # the gateways' API key (tenant "bench")

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


def start_bare_relay(sup: Any, backend: int) -> int:
    from ctxcache.net import free_port
    from ctxcache.supervisor import Child, http_ready

    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.bare_relay", "--port", str(port)]
    argv += ["--worker", f"http://127.0.0.1:{backend}"]
    sup.start(Child("bare-relay", argv, ready=http_ready(f"http://127.0.0.1:{port}/health")))
    return port


def start_stack(
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
