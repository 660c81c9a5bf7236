"""The whole stack as real processes: Redis, a sidecar, two workers, the gateway."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.lib.process import Process
from benchmarks.lib.stack import Gateway
from ctxcache.redis_server import RedisServer
from tests.stacks import WorkerStack, WorkerStackSettings

SDK = Callable[..., openai.OpenAI]
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b", "key-c": "tenant-c", "key-d": "tenant-d"}
QUOTAS = (
    '{"tenant-c": {"max_sessions": 1, "max_context_tokens": 100000},'
    ' "tenant-d": {"max_sessions": 100, "max_context_tokens": 64}}'
)


SETTINGS = WorkerStackSettings(
    worker_args=("--threads", "1", "--chunk-size", "64"),
    sidecar_args=("--disk-bytes", str(1 << 30)),
    keys=KEYS,
    gateway_env={
        "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5",
        "CTX_GATEWAY_MIN_TTL": "1",
        "CTX_MANAGER_TENANT_QUOTAS": QUOTAS,
    },
)


class Stack(WorkerStack):
    """The session's stack (`SETTINGS`): Redis, a sidecar, two workers, the gateway."""

    def client(self, key: str = "key-a", **kw: object) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=120, headers={"authorization": f"Bearer {key}"}, **kw
        )  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, tiny_model: Path
) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model, redis_server, SETTINGS).start()
    try:
        yield s
    finally:
        s.stop()


def aux_gateway(stack: Stack, name: str, workers: list[str], redis_url: str, **env: str) -> Process:
    """Another gateway in front of (some of) the stack's parts, for failure cases: started
    once it answers `/health` (its workers or Redis may be down on purpose)."""
    env = {"CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5", **env}
    gateway = Gateway(name, keys={"key-a": "tenant-a"}, env=env, log_level=None, timeout=60.0)
    return stack.extra_gateway(gateway, redis_url, workers, ready_path="/health")


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
