"""A small stack of our own for this package, for tests that kill, stop and corrupt its parts.

Redis (AOF on), one sidecar whose blocks all live on its disk tier (memory tier 0 bytes:
a SIGKILL loses none), two tiny workers with their in-process L1 off (so every reused
token comes from the sidecar, where faults show), and a gateway. Never the shared
session-scoped `stack` of tests/gateway: what these tests break must not break others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.lib.process import Process
from ctxcache.redis_server import RedisServer
from ctxcache.redis_topologies import RedisSentinelServers
from tests.stacks import WorkerStack, WorkerStackSettings

log = logging.getLogger(__name__)

API_KEYS = {"fault-key-a": "tenant-a", "fault-key-b": "tenant-b"}
CHUNK = 64  # sidecar chunk size of the workers (tokens)
REQUEST_TIMEOUT_S = 6.0  # the gateway's whole-worker-call limit in this stack
SIDECAR_TIMEOUT_S = 0.5  # the workers' per-call sidecar timeout
REDIS_TIMEOUT_S = 1.0  # the in-process manager's Redis socket timeout


SETTINGS = WorkerStackSettings(
    worker_args=(
        *("--sidecar-timeout", str(SIDECAR_TIMEOUT_S)),
        *("--threads", "1", "--chunk-size", str(CHUNK)),
    ),
    worker_env={"CTX_WORKER_L1_BYTES": "0"},
    worker_timeout=180.0,
    sidecar_args=("--memory-bytes", "0", "--disk-bytes", str(1 << 30)),
    keys=API_KEYS,
    gateway_env={
        "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5",
        "CTX_GATEWAY_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        "CTX_MANAGER_REDIS_TIMEOUT_S": str(REDIS_TIMEOUT_S),
    },
    named_routes=True,
)


class FaultStack(WorkerStack):
    """This package's stack (`SETTINGS`) on a Redis of its own, which it stops with it."""

    @property
    def blocks_dir(self) -> Path:
        return self.root / "sidecar" / "blocks"

    def client(
        self, key: str = "fault-key-a", timeout: float = 60, *, url: str | None = None
    ) -> httpx.Client:
        return httpx.Client(
            base_url=url or self.url, timeout=timeout, headers={"authorization": f"Bearer {key}"}
        )

    def wait_ready_workers(self, n: int, timeout: float = 60) -> None:
        with self.client() as c:
            wait_for(lambda: _ready_workers(c) == n, timeout, f"{n} healthy workers")

    def wait_sidecar_serving(self, timeout: float = 90) -> None:
        """Until every worker reads KV from the sidecar again (their circuit breakers back
        off up to 30 s after failures): the same prompt twice, straight to each worker."""
        prompt = f"Probe {time.monotonic()}: " + SYSTEM
        for w in self.workers:

            def served(url: str = w.url) -> bool:
                r = httpx.post(
                    f"{url}/v1/completions",
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
                    timeout=60,
                )
                return r.status_code == 200 and usage_cached(r.json()) >= CHUNK

            wait_for(served, timeout, f"{w.url} reading from the sidecar")

    def stop(self) -> None:
        super().stop()
        self.redis.stop()


def _ready_workers(c: httpx.Client) -> int:
    r = c.get("/ready")
    return int(r.json().get("workers", 0)) if r.status_code == 200 else -1


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@contextlib.contextmanager
def stopped(proc: Process | RedisServer) -> Iterator[None]:
    """SIGSTOP a process we started (a stalled, unresponsive peer); SIGCONT it afterwards."""
    assert proc.proc is not None
    pid = proc.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="package")
def fstack(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[FaultStack]:
    root = tmp_path_factory.mktemp("faults")
    s = FaultStack(root, tiny_model, RedisServer(root / "redis"), SETTINGS)
    s.redis.start()
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[RedisSentinelServers]:
    """A Sentinel set of the test's own (a master, its replicas, the sentinels)."""
    servers = RedisSentinelServers(tmp_path / "sentinel", down_after_ms=1000)
    try:
        yield servers.start()
    finally:
        servers.stop()


def usage_cached(body: dict[str, Any]) -> int:
    return int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0))


SYSTEM = "You answer from this document. " + " ".join(
    f"Clause {i} says the history of every turn stays on the server." for i in range(20)
)


class Conversation:
    """A chat session through the gateway, greedy, each turn checked against a recompute.

    The reference is the whole conversation sent without a session: no session tag, so
    none of the session's KV, and (L1 off) computed from scratch or from untagged blocks.
    """

    def __init__(self, http: httpx.Client, max_tokens: int = 6) -> None:
        self.http = http
        self.max_tokens = max_tokens
        self.history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        r = http.post("/v1/context", json={"model": "tiny", "messages": self.history, "ttl": 600})
        assert r.status_code == 200, r.text
        self.session_id: str = r.json()["session_id"]

    def turn(self, question: str, *, append: bool = True) -> dict[str, Any]:
        """One turn; asserts 200 and the same answer as the full conversation recomputed."""
        new = {"role": "user", "content": question}
        body: dict[str, Any] = {
            "model": "tiny",
            "messages": [new],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "session_id": self.session_id,
        }
        if not append:
            body["session_append"] = False
        r = self.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        want = self.reference(question)
        text = got["choices"][0]["message"]["content"]
        assert text == want["choices"][0]["message"]["content"], "not the recomputed answer"
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
        if append:
            self.history += [new, {"role": "assistant", "content": text}]
        return got  # type: ignore[no-any-return]

    def reference(self, question: str) -> dict[str, Any]:
        r = self.http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [*self.history, {"role": "user", "content": question}],
                "max_tokens": self.max_tokens,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def info(self) -> dict[str, Any]:
        """The session's record, all but what the sidecar holds (`kv_tokens`, `kv_bytes`):
        that may still be filling from the last turn's prefill, and is a cache, not history."""
        r = self.http.get(f"/v1/context/{self.session_id}")
        assert r.status_code == 200, r.text
        return {k: v for k, v in r.json().items() if k not in ("kv_tokens", "kv_bytes")}
