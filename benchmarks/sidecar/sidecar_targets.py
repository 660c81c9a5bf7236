"""The servers `ctxcache bench sidecar` compares, each started by the bench itself.

- `ctxcache`: our sidecar (`ctxcache sidecar` child process), driven by `KVClient`.
- `lmcache`: LMCache's reference server (`python -m lmcache.v1.server HOST PORT cpu`),
  driven by the same `KVClient` (same protocol, so the client cost is identical).
- `redis`: a redis-server of our own (no persistence), driven by redis-py SET/GET.

GETs of the lm:// targets receive into a buffer allocated once per client thread, the
way LMCache's connector receives into a preallocated memory object; redis-py allocates
a fresh `bytes` per GET (it has no receive-into API). A lm:// PUT has no reply, so a PUT
is timed up to an EXIST on the same connection: the server has stored it by then, as a
Redis SET has when it answers.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from benchmarks.lib.process import Process, ctxcache_argv
from benchmarks.lib.stack import sidecar_command
from ctxcache.net import free_port, wait_http, wait_tcp
from sidecar.client import KVClient
from sidecar.protocol import DTYPE_UINT8, FMT_KV_2LTD


class Ops(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> int: ...  # bytes received
    def close(self) -> None: ...


class LMOps:
    def __init__(self, port: int, size: int) -> None:
        self.client = KVClient("127.0.0.1", port, timeout=120)
        self.buf = bytearray(size)

    def put(self, key: str, data: bytes) -> None:
        self.client.put(key, data, fmt=FMT_KV_2LTD, dtype=DTYPE_UINT8, shape=(len(data), 0, 0, 0))
        if not self.client.exists(key):
            raise RuntimeError(f"PUT of {key} was not stored")

    def get(self, key: str) -> int:
        block = self.client.get_into(key, self.buf)
        if block is None:
            raise RuntimeError(f"GET of {key} missed")
        return len(block.data)

    def close(self) -> None:
        self.client.close()


class RedisOps:
    def __init__(self, port: int, size: int) -> None:
        import redis

        self.client = redis.Redis(port=port, socket_timeout=120)

    def put(self, key: str, data: bytes) -> None:
        self.client.set(key, data)

    def get(self, key: str) -> int:
        value = self.client.get(key)
        if value is None:
            raise RuntimeError(f"GET of {key} missed")
        return len(value)  # type: ignore[arg-type]

    def close(self) -> None:
        self.client.close()


class Target:
    """A server the bench starts, and a factory of per-thread clients for it."""

    name: str

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def ops(self, size: int) -> Ops: ...


class ProcessTarget(Target):
    """A server of its own (`cmd(port)`, a `Process`), ready once `port` accepts
    connections; its output in LOG_DIR/NAME.log."""

    def __init__(self, name: str, cmd: Callable[[int], list[str]], log_dir: Path) -> None:
        self.name = name
        self._cmd = cmd
        self._log_dir = log_dir
        self.port = 0
        self.proc: Process | None = None

    def _ready(self, timeout: float) -> None:
        wait_tcp("127.0.0.1", self.port, timeout=timeout)

    def start(self) -> None:
        self.port = free_port()
        log = self._log_dir / f"{self.name}.log"
        log.unlink(missing_ok=True)  # (this run's output only)
        argv = self._cmd(self.port)
        proc = Process(argv, port=self.port, ready=self._ready, log_path=log, startup_timeout=90)
        self.proc = proc.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        self.proc = None

    def ops(self, size: int) -> Ops:
        return LMOps(self.port, size)


class SidecarTarget(ProcessTarget):
    def __init__(self, log_dir: Path, memory_bytes: int) -> None:
        self.control_port = free_port()
        args = ["--memory-bytes", str(memory_bytes), "--log-level", "WARNING"]
        super().__init__(
            "ctxcache",
            lambda port: ctxcache_argv(*sidecar_command(port, self.control_port, args)),
            log_dir,
        )

    def _ready(self, timeout: float) -> None:
        wait_http(f"http://127.0.0.1:{self.control_port}/health", timeout=timeout)


class LMCacheTarget(ProcessTarget):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(
            "lmcache",
            lambda port: [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
            log_dir,
        )


class RedisTarget(Target):
    name = "redis"

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.server = None

    def start(self) -> None:
        from ctxcache.redis_server import RedisServer

        self._tmp = tempfile.TemporaryDirectory(prefix="bench-redis-")
        self.server = RedisServer(Path(self._tmp.name), appendonly=False).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def ops(self, size: int) -> Ops:
        assert self.server is not None
        return RedisOps(self.server.port, size)


def make_targets(names: list[str], log_dir: Path, memory_bytes: int) -> list[Target]:
    registry: dict[str, Callable[[], Target]] = {
        "ctxcache": lambda: SidecarTarget(log_dir, memory_bytes),
        "lmcache": lambda: LMCacheTarget(log_dir),
        "redis": RedisTarget,
    }
    return [registry[n]() for n in names]
