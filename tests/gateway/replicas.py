"""Two gateway replicas over one Redis and one built-in worker: the first with the manager
in its process, the second reaching a manager service over HTTP. For the rate-limit tests,
whose budgets must hold across replicas and both ways of reaching the store."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.utils import ServiceProcess


@contextmanager
def two_gateways(
    root: Path, redis_url: str, model: Path, *, keys: list[str], env: dict[str, str]
) -> Iterator[tuple[str, list[str]]]:
    """(the worker's URL, the two gateways' URLs); `keys` are `--api-key` specs, `env` the
    gateways' extra settings."""
    token = "manager-token-replicas"
    procs: list[ServiceProcess] = []
    try:
        worker = ServiceProcess(
            ["worker", "--model", str(model), "--threads", "1"],
            log_path=root / "worker.log",
            startup_timeout=120,
        ).start()
        procs.append(worker)
        manager = ServiceProcess(
            ["manager", "--redis-url", redis_url, "--token", token],
            log_path=root / "manager.log",
        ).start()
        procs.append(manager)
        stores = [["--redis-url", redis_url], ["--manager-url", manager.url]]
        for i, store in enumerate(stores):
            argv = ["gateway", *store, "--worker", worker.url]
            for key in keys:
                argv += ["--api-key", key]
            settings = {
                "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5",
                "CTX_GATEWAY_MANAGER_TOKEN": token,
                **env,
            }
            procs.append(
                ServiceProcess(
                    argv, log_path=root / f"gateway{i}.log", env=settings, health_path="/ready"
                ).start()
            )
        yield worker.url, [p.url for p in procs[2:]]
    finally:
        for p in procs:
            p.stop()
