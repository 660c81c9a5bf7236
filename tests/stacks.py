"""The tests' stack of tiny built-in workers: a sidecar, workers and a gateway on a Redis of
the tests' own, described by `StackSettings` and started by the one `StackBuilder`
(benchmarks/lib/stack.py) with the tests' `ProcessRunner`: each process a `Process` with
its log in the stack's root, which a test stops, kills and starts again on its ports.

tests/gateway's session-wide `stack` and tests/faults' `fstack` are this class with their
own settings (`WorkerStackSettings`) and a few helpers of their own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Self

from benchmarks.lib.process import Process
from benchmarks.lib.stack import (
    Engine,
    Gateway,
    ProcessRunner,
    StackBuilder,
    StackSettings,
    engine_service,
    gateway_service,
    route,
)
from ctxcache.net import free_port
from ctxcache.redis_server import RedisServer


@contextmanager
def started(settings: StackSettings, root: Path) -> Iterator[tuple[StackBuilder, ProcessRunner]]:
    """`settings`' stack started the tests' way: the builder (`builder.stack`, and to add
    parts to it) and its `ProcessRunner` (`runner.procs[name]`: each process a `Process`
    logging to ROOT/NAME.log); every process stopped when the block ends."""
    runner = ProcessRunner(root)
    builder = StackBuilder(settings, root, runner)
    try:
        builder.start()
        yield builder, runner
    finally:
        runner.stop()
        builder.stop()


@dataclass(frozen=True)
class WorkerStackSettings:
    """`workers` tiny built-in workers (`worker_args`, `worker_env` added; their start may
    take `worker_timeout` s), storing into one sidecar (`sidecar_args` added to its data
    dir), behind a gateway with `keys` (key -> tenant) and `gateway_env`. `named_routes`:
    the gateway knows worker i as `w<i>`."""

    workers: int = 2
    worker_args: tuple[str, ...] = ()
    worker_env: dict[str, str] = field(default_factory=dict)
    worker_timeout: float = 120.0
    sidecar_args: tuple[str, ...] = ()
    keys: dict[str, str] = field(default_factory=dict)
    gateway_env: dict[str, str] = field(default_factory=dict)
    named_routes: bool = False


class WorkerStack:
    """`settings`' stack on `redis` (which the caller owns), under `root`, the workers
    serving `model_dir`. `start()` starts it; `stop()` stops what it started."""

    def __init__(
        self, root: Path, model_dir: Path, redis: RedisServer, settings: WorkerStackSettings
    ) -> None:
        self.root = root
        self.model_dir = model_dir
        self.redis = redis
        self.settings = settings
        self.runner = ProcessRunner(root)
        sidecar = ("--data-dir", str(root / "sidecar"), *settings.sidecar_args)
        engines = tuple(self.engine(i, wait=False) for i in range(settings.workers))
        stack = StackSettings(redis=redis.url, sidecar=sidecar, engines=engines)
        self.builder = StackBuilder(stack, root, self.runner)

    def engine(self, i: int, *, wait: bool = True) -> Engine:
        """Worker `i` (`wait`: its start waits until it is healthy)."""
        s = self.settings
        return Engine(
            "builtin",
            f"worker{i}",
            args=s.worker_args,
            model=self.model_dir,
            store=True,
            wait=wait,
            route=f"w{i}" if s.named_routes else None,
            env=dict(s.worker_env),
            startup_timeout=s.worker_timeout,
        )

    def gateway_settings(self, name: str, env: dict[str, str] | None = None) -> Gateway:
        """The stack's gateway, called `name` (its log: ROOT/NAME.log), `env` added."""
        s = self.settings
        env = {**s.gateway_env, **(env or {})}
        return Gateway(name, keys=dict(s.keys), env=env, log_level=None, timeout=60.0)

    def start(self) -> Self:
        """Redis is up; the sidecar, then the workers side by side (each loads the model),
        then the gateway once every worker is healthy. Stopped again if a part fails."""
        try:
            self.builder.start()
            for worker in self.workers:
                worker.until_ready("/health")
            self.builder.gateway(self.gateway_settings("gateway"))
        except BaseException:
            self.stop()
            raise
        return self

    # -- its processes -------------------------------------------------------------------------
    @property
    def sidecar(self) -> Process:
        return self.runner.procs["sidecar"]

    @property
    def workers(self) -> list[Process]:
        return [self.runner.procs[f"worker{i}"] for i in range(self.settings.workers)]

    @property
    def gateway(self) -> Process:
        return self.runner.procs["gateway"]

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def sidecar_url(self) -> str:
        return self.sidecar.url

    @property
    def sidecar_lm(self) -> str:
        lm = self.builder.stack.sidecar_lm
        assert lm is not None
        return lm

    def routes(self) -> list[str]:
        """The gateway's `--worker` values for this stack's workers."""
        named = self.settings.named_routes
        return [
            route(w.url, self.sidecar_url, f"w{i}" if named else None)
            for i, w in enumerate(self.workers)
        ]

    # -- starting and stopping parts -----------------------------------------------------------
    def start_sidecar(self) -> None:
        """Start the sidecar again (stopped first if it runs): same ports, same data dir."""
        self.sidecar.stop()
        self.sidecar.start()

    def restart_worker(self, i: int) -> None:
        self.restart_workers([i])

    def restart_workers(self, indices: Sequence[int]) -> None:
        """Stop these workers, then start them again on their ports side by side."""
        procs = [self.workers[i] for i in indices]
        for proc in procs:
            proc.stop()
        for proc in procs:
            proc.spawn()
        for proc in procs:
            proc.until_ready("/health")

    def worker_proc(self, i: int, port: int | None = None) -> Process:
        """Another worker (`i`: its log, ROOT/worker<i>.log) storing into the stack's
        sidecar, not started; the caller starts and stops it."""
        service = engine_service(self.engine(i), port or free_port(), self.sidecar_lm)
        return service.process(self.root / f"{service.name}.log")

    def start_gateway(
        self, redis_url: str, name: str, env: dict[str, str] | None = None
    ) -> Process:
        """Another gateway like the stack's (`env` added) on `redis_url`, started; the
        caller stops it."""
        return self.extra_gateway(self.gateway_settings(name, env), redis_url)

    def extra_gateway(
        self,
        gateway: Gateway,
        redis_url: str,
        workers: Sequence[str] | None = None,
        ready_path: str = "/ready",
    ) -> Process:
        """`gateway` (in-process manager) on `redis_url` in front of `workers` (`--worker`
        values; None: this stack's workers), started once `ready_path` answers (`/health`:
        a gateway whose workers or store are meant to be down); the caller stops it."""
        workers = self.routes() if workers is None else workers
        service = gateway_service(gateway, free_port(), ["--redis-url", redis_url], workers)
        service = replace(service, ready_path=ready_path)
        return service.process(self.root / f"{gateway.name}.log").start()

    def stop(self) -> None:
        """Stop every process it started, the newest first."""
        self.runner.stop()
        self.builder.stop()
