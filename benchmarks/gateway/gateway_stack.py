"""The processes `ctxcache bench gateway` runs, and where they run: Redis, the fake backend,
the tiny model's worker, a sidecar and the gateways (`start_stack`), the bare ASGI relay of
--floor, and the CPUs of each (`Placement`, --pin), on the one stack builder
(benchmarks/lib/stack.py). `ctxcache bench gateway-ab` starts its own stack from the same
parts (`bench_stack`, `bench_gateway`). See benchmarks/gateway/gateway.py."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.lib.stack import Engine, Gateway, StackBuilder

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
        from benchmarks.lib.util import pin

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
    """The bare ASGI relay of --floor in front of the backend on port `backend`: its port."""
    from benchmarks.lib.stack import Engine, SupervisorRunner, engine_service
    from ctxcache.net import free_port

    relay = Engine("relay", "bare-relay", backend=f"http://127.0.0.1:{backend}")
    service = engine_service(relay, free_port(), None)
    SupervisorRunner(sup).start(service)
    return service.port


def bench_stack(sup: Any, tmp: Path, engines: tuple[Engine, ...]) -> StackBuilder:
    """Redis and a real sidecar, as in production (session turns pin their KV there; its
    control API only), and `engines`, under `sup`: no gateway yet (`bench_gateway`)."""
    from benchmarks.lib.stack import StackBuilder, StackSettings, SupervisorRunner

    settings = StackSettings(sidecar=("--log-level", "WARNING"), engines=engines)
    builder = StackBuilder(settings, tmp, SupervisorRunner(sup))
    builder.start()
    return builder


def bench_gateway(
    name: str, *, tree: Path | None = None, env: dict[str, str] | None = None
) -> Gateway:
    """A gateway with the bench's key in front of every engine (`tree`: started from that
    checkout)."""
    from benchmarks.lib.stack import Gateway

    return Gateway(name, keys={KEY: "bench"}, env=dict(env or {}), tree=tree)


def start_stack(
    sup: Any, tmp: Path, args: argparse.Namespace
) -> tuple[int, dict[str, int], int | None]:
    """Redis, the fake backend, the tiny worker (unless --no-model), a sidecar and a
    gateway (--tracing: and a traced one, with its OTLP receiver).

    The worker, the slowest to start, starts first and comes up while the rest do; the
    gateway is ready once its pool lists every backend's model. Returns (gateway port,
    {model: backend port}, the traced gateway's port or None).
    """
    import httpx

    from benchmarks.lib.stack import Engine, module_service
    from benchmarks.lib.util import ensure_preset
    from ctxcache import tracing
    from ctxcache.net import free_port

    engines = {"fake": Engine("fake", "fake")}  # model -> its engine
    if not args.no_model:
        ensure_preset("tiny", args.model_dir, quiet=True)
        tiny = Engine("builtin", "worker", ("--model-name", "tiny"), args.model_dir, wait=False)
        engines = {"tiny": tiny, **engines}  # readiness checked below
    builder = bench_stack(sup, tmp, tuple(engines.values()))
    tree = args.gateway_tree
    off = {tracing.ENDPOINT_ENV: ""}  # off, whatever the shell says
    ports = [builder.gateway(bench_gateway("gateway", tree=tree, env=off)).port]
    traced_port = None
    if args.tracing:
        sink = module_service("otlp-sink", "benchmarks.lib.otlp_sink", free_port())
        builder.add(sink)
        on = {tracing.ENDPOINT_ENV: sink.url}
        traced_port = builder.gateway(bench_gateway("traced-gateway", tree=tree, env=on)).port
        ports.append(traced_port)
    deadline = time.monotonic() + 180
    for gw_port in ports:
        while True:
            r = httpx.get(f"http://127.0.0.1:{gw_port}/v1/models", timeout=5)
            if {m["id"] for m in r.json()["data"]} >= engines.keys():
                break
            code = None if args.no_model else builder.engine_exited("worker")
            if code is not None:
                raise RuntimeError(f"the worker exited with {code}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway does not list {sorted(engines)} after 180 s")
            time.sleep(0.2)
    backends = {model: builder.stack.ports[e.name] for model, e in engines.items()}
    return ports[0], {"fake": backends["fake"], **backends}, traced_port
