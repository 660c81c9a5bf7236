"""The whole stack as real processes: Redis, a sidecar, two workers, the gateway."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from ctxcache.redis_server import RedisServer
from tests.utils import ServiceProcess, SidecarProcess, start_all

SDK = Callable[..., openai.OpenAI]
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-c": "tenant-c", "key-d": "tenant-d"}
QUOTAS = (
    '{"tenant-c": {"max_sessions": 1, "max_context_tokens": 100000},'
    ' "tenant-d": {"max_sessions": 100, "max_context_tokens": 64}}'
)


@dataclass
class Stack:
    root: Path
    redis: RedisServer
    model_dir: Path
    sidecar: ServiceProcess | None = None
    sidecar_data_port: int = 0
    workers: list[ServiceProcess] = field(default_factory=list)
    gateway: ServiceProcess | None = None

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    @property
    def sidecar_url(self) -> str:
        assert self.sidecar is not None
        return self.sidecar.url

    def start_sidecar(self) -> None:
        """Start (or restart, on the same ports and data dir) the stack's sidecar."""
        data = self.root / "sidecar"
        data.mkdir(exist_ok=True)
        self.sidecar = SidecarProcess(
            data,
            data_port=self.sidecar_data_port or None,
            control_port=self.sidecar.port if self.sidecar else None,
            log_path=self.root / "sidecar.log",
        ).start()
        self.sidecar_data_port = self.sidecar.data_port

    def worker_proc(self, i: int, port: int | None = None) -> ServiceProcess:
        return ServiceProcess(
            [
                "worker",
                "--model",
                str(self.model_dir),
                "--sidecar",
                f"lm://127.0.0.1:{self.sidecar_data_port}",
                "--threads",
                "1",
                "--chunk-size",
                "64",
            ],
            port=port,
            log_path=self.root / f"worker{i}.log",
            startup_timeout=120,
        )

    def restart_worker(self, i: int) -> None:
        self.restart_workers([i])

    def restart_workers(self, indices: list[int]) -> None:
        """Stop these workers, then start them again on their ports side by side."""
        old = [self.workers[i] for i in indices]
        for proc in old:
            proc.stop()
        again = [self.worker_proc(i, port=p.port) for i, p in zip(indices, old, strict=True)]
        new = start_all(again)
        for i, proc in zip(indices, new, strict=True):
            self.workers[i] = proc

    def client(self, key: str = "key-a", **kw: object) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=120, headers={"authorization": f"Bearer {key}"}, **kw
        )  # type: ignore[arg-type]

    def stop(self) -> None:
        for proc in [self.gateway, *self.workers, self.sidecar]:
            if proc is not None:
                proc.stop()


@pytest.fixture(scope="session")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, tiny_model: Path
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("stack")
    s = Stack(root=root, redis=redis_server, model_dir=tiny_model)
    try:
        s.start_sidecar()
        s.workers = start_all([s.worker_proc(i) for i in range(2)])
        argv = ["gateway", "--redis-url", redis_server.url]
        for w in s.workers:
            argv += ["--worker", f"{w.url}={s.sidecar_url}"]
        for key, tenant in KEYS.items():
            argv += ["--api-key", f"{key}={tenant}"]
        s.gateway = ServiceProcess(
            argv,
            log_path=root / "gateway.log",
            env={
                "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5",
                "CTX_GATEWAY_MIN_TTL": "1",
                "CTX_MANAGER_TENANT_QUOTAS": QUOTAS,
            },
            health_path="/ready",
        ).start()
        yield s
    finally:
        s.stop()


def aux_gateway(
    stack: Stack, name: str, workers: list[str], redis_url: str, **env: str
) -> ServiceProcess:
    """Another gateway in front of (some of) the stack's parts, for failure cases."""
    argv = ["gateway", "--redis-url", redis_url, "--api-key", "key-a=tenant-a"]
    for w in workers:
        argv += ["--worker", w]
    return ServiceProcess(
        argv,
        log_path=stack.root / f"{name}.log",
        env={"CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5", **env},
    ).start()


@pytest.fixture
def sdk(stack: Stack) -> Iterator[SDK]:
    """`sdk(key="key-a", url=None)`: an openai client on the stack's gateway (or the
    gateway at `url`), no retries, closed when the test ends (a client left to the garbage
    collector may leave its sockets unclosed, and their warning then fails whichever later
    test collects them)."""
    made: list[openai.OpenAI] = []

    def make(key: str = "key-a", url: str | None = None) -> openai.OpenAI:
        base = url or stack.url
        made.append(openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0))
        return made[-1]

    yield make
    for client in made:
        client.close()
