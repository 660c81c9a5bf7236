"""The one stack builder of the benchmarks and the tests: Redis, a sidecar, engines and
gateways as real processes on free ports, described by `StackSettings` and started by
`StackBuilder` (after vLLM's benchmarks/lib/ and tests/utils.py::RemoteOpenAIServer).

- Redis: `bundled` (a redis-server of the stack's own, `ctxcache.redis_server`), `cluster`
  (a Redis Cluster of its own, `ctxcache.redis_topologies`) or a running server's URL.
- The sidecar (optional): its control API for the gateway's pins, its lm:// port for the
  engines that store KV.
- Engines (`Engine`): the built-in worker, vLLM (`ctxcache vllm`), the fake worker
  (`benchmarks.lib.fake_worker`) or the bare relay (`benchmarks.lib.bare_relay`).
- Gateways (`Gateway`): API keys, environment, extra arguments, which engines they route to
  and the checkout they run from (`tree`: `bench gateway --gateway-tree`, `gateway-ab`).

Each process is a `Service` (process.py) that a runner starts: `SupervisorRunner` (the
benchmarks: ctxcache's `Supervisor`, one log with prefixed lines, Ctrl-C) or `ProcessRunner`
(the tests: a `Process` with a log file each, stopped in reverse order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from benchmarks.lib.process import (
    Process,
    Service,
    ctxcache_argv,
    module_argv,
    tree_env,
    url_of,
    wait_ready,
)

if TYPE_CHECKING:
    from ctxcache.supervisor import Supervisor

EngineKind = Literal["builtin", "vllm", "fake", "relay"]


# -- the parts ---------------------------------------------------------------------------------
def sidecar_command(data_port: int, control_port: int, args: Sequence[str] = ()) -> list[str]:
    """`ctxcache sidecar`'s arguments: lm:// on `data_port`, its control API on
    `control_port`, then `args` (memory, disk, data and local dirs, log level)."""
    return ["sidecar", "--port", str(data_port), "--control-port", str(control_port), *args]


def sidecar_service(
    *,
    data_port: int | None = None,
    control_port: int | None = None,
    args: Sequence[str] = (),
    name: str = "sidecar",
    env: dict[str, str] | None = None,
) -> tuple[Service, int]:
    """`ctxcache sidecar` on these ports (free ones unless given), `sidecar_command`, with
    `env` added: the service (ready on its control port) and its data port."""
    from ctxcache.net import free_port

    data = data_port or free_port()
    control = control_port or free_port()
    argv = ctxcache_argv(*sidecar_command(data, control, args))
    return Service(name, argv, control, env=dict(env or {})), data


def module_service(name: str, module: str, port: int, *args: str) -> Service:
    """`python -m MODULE --port PORT ARGS...`, ready once its `/health` answers (a server
    of ours: `benchmarks.lib.otlp_sink`, `benchmarks.lib.fake_worker`)."""
    return Service(name, module_argv(module, "--port", str(port), *args), port)


def engine_service(engine: Engine, port: int, sidecar_lm: str | None) -> Service:
    """The process of `engine` on `port`; `sidecar_lm`: where it stores KV (if it does)."""
    store = ["--sidecar", sidecar_lm] if sidecar_lm and engine.store else []
    if engine.command:
        argv = list(engine.command)
    elif engine.kind == "fake":
        argv = module_argv("benchmarks.lib.fake_worker", "--port", str(port), *store)
    elif engine.kind == "relay":
        argv = module_argv("benchmarks.lib.bare_relay", "--port", str(port))
        argv += ["--worker", str(engine.backend)]
    else:  # `ctxcache worker` or `ctxcache vllm`
        command = "worker" if engine.kind == "builtin" else "vllm"
        model = ["--model", str(engine.model)] if engine.model is not None else []
        argv = ctxcache_argv(command, *model, "--port", str(port), *store)
    ready = "/health" if engine.wait else None
    timeout = engine.startup_timeout
    group = engine.kind == "vllm"  # (its engine core and workers are its children)
    argv += engine.args
    return Service(engine.name, argv, port, ready, dict(engine.env), timeout, group)


def manager_service(
    redis_url: str, token: str, name: str = "manager", env: dict[str, str] | None = None
) -> Service:
    """`ctxcache manager` on a free port over `redis_url`, its API behind `token` (a
    gateway's `--manager-url` store), with `env` added."""
    from ctxcache.net import free_port

    port = free_port()
    argv = ctxcache_argv("manager", "--redis-url", redis_url, "--token", token)
    return Service(name, [*argv, "--port", str(port)], port, env=dict(env or {}))


def route(url: str, sidecar: str | None = None, name: str | None = None) -> str:
    """A gateway's `--worker` value: `[NAME@]URL[=SIDECAR]`."""
    return f"{name + '@' if name else ''}{url}{'=' + sidecar if sidecar else ''}"


def gateway_service(
    gateway: Gateway, port: int, store: Sequence[str], workers: Sequence[str]
) -> Service:
    """`ctxcache gateway` on `port` (from `gateway.tree` if set), on `store`
    (`--redis-url URL` or `--manager-url URL`), in front of `workers` (`route` values)."""
    argv = ctxcache_argv("gateway", "--port", str(port), *store, tree=gateway.tree)
    for key, tenant in gateway.keys.items():
        argv += ["--api-key", f"{key}={tenant}"]
    for worker in workers:
        argv += ["--worker", worker]
    if gateway.log_level:
        argv += ["--log-level", gateway.log_level]
    env = {**gateway.env, **tree_env(gateway.tree)}
    return Service(gateway.name, [*argv, *gateway.args], port, "/ready", env, gateway.timeout)


# -- what a stack is made of -------------------------------------------------------------------
@dataclass(frozen=True)
class Engine:
    """One engine: `kind`, its process's `name`, `args` added to its command line. `store`:
    it stores KV into the stack's sidecar. `wait`: its start waits until it is healthy, else
    it starts first (right after the sidecar where it stores into it) and comes up
    meanwhile (`StackBuilder.wait_engines`). `route`:
    the gateway's name for it (`w0@`). `backend`: the URL a relay relays to. `command`
    and `port`: its whole command line and port, where it picked them (a `VllmLaunch`)."""

    kind: EngineKind
    name: str
    args: tuple[str, ...] = ()
    model: Path | None = None
    store: bool = False
    wait: bool = True
    route: str | None = None
    backend: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 120.0
    command: tuple[str, ...] = ()
    port: int | None = None


@dataclass(frozen=True)
class Gateway:
    """A gateway: its process's `name`, API keys (key -> tenant), environment and `args`
    added; `tree`: the checkout it runs from (None: this one); `engines`: the names of
    those it routes to (None: every engine); `sidecar`: each route names the sidecar."""

    name: str = "gateway"
    keys: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    log_level: str | None = "WARNING"
    tree: Path | None = None
    engines: tuple[str, ...] | None = None
    sidecar: bool = True
    timeout: float = 120.0


@dataclass(frozen=True)
class StackSettings:
    """Redis (`bundled`, `cluster`, the URL of a running server or None), the sidecar (None:
    none; else the arguments added to its command line; `sidecar_env` added to its
    environment), the engines and the gateway (None: none yet; `StackBuilder.gateway` adds
    gateways later)."""

    redis: str | None = "bundled"
    redis_appendonly: bool = True
    sidecar: tuple[str, ...] | None = ()
    sidecar_env: dict[str, str] = field(default_factory=dict)
    engines: tuple[Engine, ...] = ()
    gateway: Gateway | None = None


# -- starting them -----------------------------------------------------------------------------
class Runner(Protocol):
    """Starts a service: waits until it is ready (`Service.ready_path`, or `probe`); its pid."""

    def start(self, service: Service, probe: Callable[[float], None] | None = None) -> int: ...

    def exited(self, name: str) -> int | None: ...

    def stopping(self) -> bool: ...


class SupervisorRunner:
    """The benchmarks' runner: each service a child of `sup` (stopped with it)."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    def start(self, service: Service, probe: Callable[[float], None] | None = None) -> int:
        child = service.child()
        if probe is not None:
            child.ready = probe
        self.sup.start(child)
        assert child.proc is not None
        return child.proc.pid

    def exited(self, name: str) -> int | None:
        child = next(c for c in self.sup.children if c.name == name)
        return None if child.proc is None else child.proc.poll()

    def stopping(self) -> bool:
        return self.sup.stopping.is_set()


class ProcessRunner:
    """The tests' runner: each service a `Process` logging to `ROOT/NAME.log`; `stop()`
    stops them newest first."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, Process] = {}

    def start(self, service: Service, probe: Callable[[float], None] | None = None) -> int:
        proc = service.process(self.root / f"{service.name}.log", probe)
        self.procs[service.name] = proc
        proc.start()
        assert proc.proc is not None
        return proc.proc.pid

    def exited(self, name: str) -> int | None:
        proc = self.procs[name].proc
        return None if proc is None else proc.poll()

    def stopping(self) -> bool:
        return False

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        self.procs.clear()


@dataclass
class Stack:
    """A started stack: its Redis URL, the sidecar's control URL and lm:// URL (None
    without one), each engine's and gateway's port and each process's pid, by name."""

    redis_url: str | None
    sidecar: str | None
    sidecar_lm: str | None
    ports: dict[str, int] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    gateways: list[str] = field(default_factory=list)  # their names, first started first

    def url(self, name: str) -> str:
        return url_of(self.ports[name])

    @property
    def gateway(self) -> str:
        """The URL of the first gateway."""
        return self.url(self.gateways[0])


class StackBuilder:
    """Starts `settings`' stack with `runner`, under `root` (Redis's files): first the
    engines that do not wait and store nothing (a model that loads meanwhile), then Redis,
    the sidecar, the engines that store into it and the rest, then the gateway."""

    def __init__(self, settings: StackSettings, root: Path, runner: Runner) -> None:
        self.settings = settings
        self.root = root
        self.runner = runner
        self.engines: dict[str, Engine] = {e.name: e for e in settings.engines}
        self.owned = contextlib.ExitStack()

    def start(self) -> Stack:
        """Start the stack (the runner's owner stops it; `stop()`, what it started beside
        the runner: a Redis Cluster)."""
        from ctxcache.net import free_port

        s = self.settings
        ports = {e.name: e.port or free_port() for e in s.engines}
        pids: dict[str, int] = {}
        for e in s.engines:  # first, the slowest to start that need no sidecar
            if not e.wait and not e.store:
                pids[e.name] = self.runner.start(engine_service(e, ports[e.name], None))
        redis_url = self._redis(pids)
        sidecar = lm = None
        if s.sidecar is not None:
            service, data_port = sidecar_service(args=s.sidecar, env=s.sidecar_env)
            pids[service.name] = self.runner.start(service)
            sidecar, lm = service.url, f"lm://127.0.0.1:{data_port}"
        for e in sorted(s.engines, key=lambda e: e.wait):  # (stable: those that wait last)
            if e.wait or e.store:
                pids[e.name] = self.runner.start(engine_service(e, ports[e.name], lm))
        self.stack = Stack(redis_url, sidecar, lm, ports, pids)
        if s.gateway is not None:
            self.gateway(s.gateway)
        return self.stack

    def stop(self) -> None:
        self.owned.close()

    @contextlib.contextmanager
    def started(self) -> Iterator[Stack]:
        """`start()`, and `stop()` when the block ends."""
        try:
            yield self.start()
        finally:
            self.stop()

    def _redis(self, pids: dict[str, int]) -> str | None:
        mode = self.settings.redis
        if mode is None:
            return None
        if mode == "cluster":
            from ctxcache.redis_topologies import RedisClusterServers

            cluster = RedisClusterServers(self.root / "cluster")
            self.owned.callback(cluster.stop)
            return str(cluster.start().url)
        if mode != "bundled":
            return mode  # a running server's URL
        from ctxcache.redis_server import RedisServer

        redis = RedisServer(self.root / "redis", appendonly=self.settings.redis_appendonly)
        redis.data_dir.mkdir(parents=True, exist_ok=True)
        service = Service("redis", redis.argv(), redis.port, None)
        pids["redis"] = self.runner.start(service, probe=redis.wait_ready)
        return redis.url

    def gateway(self, gateway: Gateway, store: Sequence[str] | None = None) -> Service:
        """Start `gateway` in front of its engines, on the stack's Redis unless `store`
        says otherwise; ready once `/ready` says so."""
        from ctxcache.net import free_port

        stack = self.stack
        names = gateway.engines if gateway.engines is not None else list(self.engines)
        sidecar = stack.sidecar if gateway.sidecar else None
        workers = [route(stack.url(n), sidecar, self.engines[n].route) for n in names]
        if store is None:
            assert stack.redis_url is not None, "a stack without Redis: give the gateway a store"
            store = ["--redis-url", stack.redis_url]
        service = gateway_service(gateway, free_port(), store, workers)
        stack.pids[gateway.name] = self.runner.start(service)
        stack.ports[gateway.name] = service.port
        stack.gateways.append(gateway.name)
        return service

    def add_engine(self, engine: Engine) -> Service:
        """Start one more engine (storing into the stack's sidecar if it does); the
        gateways started after this can route to it."""
        from ctxcache.net import free_port

        service = engine_service(engine, engine.port or free_port(), self.stack.sidecar_lm)
        self.engines[engine.name] = engine
        self.add(service)
        return service

    def add(self, service: Service) -> int:
        """Start one more process beside the stack (an OTLP receiver, a relay): its pid."""
        self.stack.pids[service.name] = self.runner.start(service)
        self.stack.ports[service.name] = service.port
        return self.stack.pids[service.name]

    def wait_engines(self, timeout: float = 900.0) -> None:
        """Until every engine that did not wait at its start answers `/health`; fails as soon
        as one exits."""
        from ctxcache.net import wait_http

        for e in self.settings.engines:
            if not e.wait:
                url = f"{self.stack.url(e.name)}/health"
                wait_ready(
                    lambda t, url=url: wait_http(url, timeout=t),  # type: ignore[misc]
                    lambda name=e.name: self.runner.exited(name),  # type: ignore[misc]
                    timeout=timeout,
                    what=e.name,
                    stopping=self.runner.stopping,
                )

    def engine_exited(self, name: str) -> int | None:
        """The return code of engine `name` if it has exited (None while it runs)."""
        return self.runner.exited(name)
