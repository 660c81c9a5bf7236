"""One process of a stack: what starts it (`Service`: argv, env, the port and path that say
it is ready) and, for the tests, a child process with a log file that is ready once that
URL answers (`Process`, after vLLM's tests/utils.py::RemoteOpenAIServer).

Benchmarks run their services under ctxcache's own `Supervisor` (`Service.child()`: prefixed
logs, Ctrl-C, nothing left behind); tests run each as a `Process` (`Service.process()`),
which they stop, kill and start again one by one. `stack.py` says which services a stack is made of.

Imports nothing heavy at module level: the GPU check runs the tests' helpers where only
torch, pytest and httpx are (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Self

from ctxcache.reaper import die_with_parent

if TYPE_CHECKING:
    from ctxcache.supervisor import Child

LOCALHOST = "127.0.0.1"


def ctxcache_argv(*args: str, tree: Path | None = None) -> list[str]:
    """`ctxcache ARGS...` as this interpreter runs it; `tree`: from that checkout (-P: the
    checkout on PYTHONPATH, see `tree_env`, not the working directory)."""
    return [sys.executable, *(["-P"] if tree is not None else []), "-m", "ctxcache.cli", *args]


def module_argv(module: str, *args: str) -> list[str]:
    """`python -m MODULE ARGS...` (a server of the benchmarks': `benchmarks.lib.fake_worker`)."""
    return [sys.executable, "-m", module, *args]


def tree_env(tree: Path | None) -> dict[str, str]:
    """The environment that makes `ctxcache_argv(..., tree=tree)` run `tree`'s code."""
    return {} if tree is None else {"PYTHONPATH": str(tree.resolve())}


def url_of(port: int) -> str:
    return f"http://{LOCALHOST}:{port}"


@dataclass
class Service:
    """A process of a stack, not started: `argv` with `env` added to this one's, ready once
    `ready_path` on `port` answers 2xx (None: not polled; whoever starts it checks).
    `group`: a server with children of its own (vLLM's engine core), stopped as a group."""

    name: str
    argv: list[str]
    port: int
    ready_path: str | None = "/health"
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 120.0
    group: bool = False

    @property
    def url(self) -> str:
        return url_of(self.port)

    def ready(self, timeout: float) -> None:
        """Block up to `timeout` s until it answers; TimeoutError otherwise."""
        from ctxcache.net import wait_http

        if self.ready_path is not None:
            wait_http(self.url + self.ready_path, timeout=timeout)

    def child(self) -> Child:
        """This service as a child of ctxcache's `Supervisor`."""
        from ctxcache.supervisor import Child

        ready = self.ready if self.ready_path is not None else None
        timeout = self.startup_timeout
        return Child(self.name, self.argv, ready=ready, env=self.env, startup_timeout=timeout)

    def process(
        self, log_path: Path | None = None, ready: Callable[[float], None] | None = None
    ) -> Process:
        """This service as a test's `Process` (not started), its output in `log_path`;
        `ready`: the check that it is up, instead of `ready_path`."""
        return Process(
            self.argv,
            port=self.port,
            health_path=self.ready_path,
            ready=ready,
            log_path=log_path,
            env=self.env,
            startup_timeout=self.startup_timeout,
            group=self.group,
        )


def wait_ready(
    ready: Callable[[float], None],
    exited: Callable[[], int | None],
    *,
    timeout: float,
    what: str,
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """Until `ready(1.0)` returns; RuntimeError as soon as `exited()` gives a return code or
    after `timeout` s; KeyboardInterrupt once `stopping()` (a supervisor asked to stop)."""
    deadline = time.monotonic() + timeout
    while True:
        if stopping():
            raise KeyboardInterrupt
        code = exited()
        if code is not None:
            raise RuntimeError(f"{what} exited with {code} while starting")
        try:
            ready(1.0)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not healthy after {timeout:.0f}s") from None


class Process:
    """`argv` as a child process in a session of its own, its output in `log_path` (or
    nowhere), ready once `http://127.0.0.1:<health_port><health_path>` answers 2xx (or
    `ready(timeout)` returns, where given; neither: once spawned). `group`: stopping
    signals its whole process group (a server with children of its own, such as vLLM's
    engine core)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        port: int,
        health_port: int | None = None,
        health_path: str | None = "/health",
        ready: Callable[[float], None] | None = None,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
        group: bool = False,
    ) -> None:
        self.command = list(argv)
        self.port = port
        self.health_port = health_port or port
        self.health_path = health_path
        self.ready = ready
        self.log_path = log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.startup_timeout = startup_timeout
        self.group = group
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return url_of(self.port)

    def start(self) -> Self:
        """Spawn it and wait until it is ready (`until_ready`)."""
        return self.spawn().until_ready()

    def spawn(self) -> Self:
        """Start it, not waiting for anything (`until_ready` waits)."""
        with contextlib.ExitStack() as files:
            out: IO[bytes] | int = subprocess.DEVNULL
            if self.log_path:
                out = files.enter_context(open(self.log_path, "ab"))
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # SIGKILLed if the benchmark or test dies
            )
        return self

    def until_ready(self, health_path: str | None = None) -> Self:
        """Wait until it is ready: `ready` returns, else `health_path` (given here, or its
        own) answers 2xx; neither: at once. Stopped, with its log in the error, if it exits
        first or is not ready in `startup_timeout` s."""
        from ctxcache.net import wait_http

        assert self.proc is not None, "not started"
        ready = self.ready
        path = health_path or self.health_path
        if ready is None:
            if path is None:
                return self
            url = f"{url_of(self.health_port)}{path}"
            ready = lambda timeout: wait_http(url, timeout=timeout)  # noqa: E731
        try:
            wait_ready(
                ready,
                self.proc.poll,
                timeout=self.startup_timeout,
                what=str(self.command),
            )
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"{self.command} did not become healthy:\n{self.logs()}") from None
        return self

    def logs(self) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")[-4000:]
        return "(no log)"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """`sig` to it (its process group, with `group`), SIGKILL if it is not gone in 15 s
        (30 s for a group, and then whatever is left of the group)."""
        if self.proc is None:
            return
        if self.group:
            self._stop_group(self.proc, sig)
        elif self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    @staticmethod
    def _stop_group(proc: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything left of the group
        proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def send_signal(self, sig: int) -> None:
        """`sig` to it alone (SIGHUP: a gateway reloads its keys file)."""
        assert self.proc is not None, "not started"
        self.proc.send_signal(sig)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
