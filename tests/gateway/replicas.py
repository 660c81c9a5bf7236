"""Two gateway replicas over one Redis and one built-in worker: the first with the manager
in its process, the second reaching a manager service over HTTP. For the rate-limit tests,
whose budgets must hold across replicas and both ways of reaching the store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.lib.stack import Engine, Gateway, StackSettings, manager_service
from tests.stacks import started


@contextmanager
def two_gateways(
    root: Path, redis_url: str, model: Path, *, keys: list[str], env: dict[str, str]
) -> Iterator[tuple[str, list[str]]]:
    """(the worker's URL, the two gateways' URLs); `keys` are `--api-key` specs, `env` the
    gateways' extra settings. Started by the one stack builder, the tests' way."""
    token = "manager-token-replicas"
    worker = Engine("builtin", "worker", args=("--threads", "1"), model=model)
    settings = StackSettings(redis=redis_url, sidecar=None, engines=(worker,))
    with started(settings, root) as (builder, _):
        stack = builder.stack
        builder.add(manager_service(redis_url, token))
        stores = [["--redis-url", redis_url], ["--manager-url", stack.url("manager")]]
        env = {"CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5", "CTX_GATEWAY_MANAGER_TOKEN": token, **env}
        tenants = dict(key.split("=", 1) for key in keys)
        for i, store in enumerate(stores):
            gateway = Gateway(f"gateway{i}", tenants, env, log_level=None, timeout=60.0)
            builder.gateway(gateway, store)
        yield stack.url("worker"), [stack.url(name) for name in stack.gateways]
