"""Run child processes as one stack: health-gated start, prefixed logs, clean stop.

Used by `ctxcache serve`. Each child runs in its own process group so a stop reaches its
children too; SIGINT/SIGTERM to the supervisor stops every child (SIGTERM, then SIGKILL
after a grace period) and nothing is left behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ctxcache.net import wait_http

__all__ = ["Child", "Interrupted", "Supervisor", "http_ready"]

log = logging.getLogger(__name__)


@dataclass
class Child:
    name: str
    argv: Sequence[str]
    ready: Callable[[float], None] | None = None  # blocks until up; raises TimeoutError
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 120.0
    proc: subprocess.Popen[bytes] | None = None


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived while the stack was starting."""


class Supervisor:
    """Use as a context manager: from entry on, SIGINT/SIGTERM request a clean stop."""

    def __init__(self, *, out: IO[str] | None = None, grace_s: float = 10.0) -> None:
        self.children: list[Child] = []
        self.out = out or sys.stdout
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self.stopping = threading.Event()
        self._old_handlers: dict[int, Any] = {}

    def __enter__(self) -> Supervisor:
        def on_signal(signum: int, frame: object) -> None:
            self.stopping.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)

    def start(self, child: Child) -> Child:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env}
        child.proc = subprocess.Popen(
            list(child.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.children.append(child)
        pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
        self._pumps.append(pump)
        pump.start()
        if child.ready is not None:
            deadline = time.monotonic() + child.startup_timeout
            while True:
                if self.stopping.is_set():
                    raise Interrupted()
                if child.proc.poll() is not None:
                    raise RuntimeError(f"{child.name} exited with {child.proc.returncode}")
                try:
                    child.ready(1.0)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{child.name} not healthy after {child.startup_timeout}s"
                        ) from None
        log.info("%s is up (pid %d)", child.name, child.proc.pid)
        return child

    def _pump(self, child: Child) -> None:
        assert child.proc is not None and child.proc.stdout is not None
        prefix = f"{child.name:>8} | "
        with child.proc.stdout:  # closed at the child's EOF (it exited, its group killed)
            for raw in iter(child.proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                with self._lock:
                    if self.out.closed:  # its owner closed it: a child that outlived stop()
                        continue
                    self.out.write(prefix + line + "\n")
                    self.out.flush()

    def wait(self) -> int:
        """Block until a signal asks for a stop (0) or a child exits on its own (1)."""
        while not self.stopping.wait(0.5):
            for child in self.children:
                if child.proc is not None and child.proc.poll() is not None:
                    log.error(
                        "%s exited with %s; stopping the stack", child.name, child.proc.returncode
                    )
                    return 1
        return 0

    def stop(self) -> None:
        """SIGTERM every child's process group, newest first; SIGKILL what lingers."""
        for child in reversed(self.children):
            if child.proc is not None and child.proc.poll() is None:
                _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %ss; killing it", child.name, self.grace_s)
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait()
            _signal_group(child.proc, signal.SIGKILL)  # anything its children left
        self.children.clear()
        # the children's last lines are written before stop() returns, so whoever owns
        # `out` may close it then (a pipe a process outside the group still holds: 1 s)
        for pump in self._pumps:
            pump.join(timeout=1.0)
        self._pumps.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def http_ready(url: str) -> Callable[[float], None]:
    return lambda timeout: wait_http(url, timeout=timeout)
