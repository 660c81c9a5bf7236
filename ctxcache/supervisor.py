"""Run child processes as one stack: health-gated start, restarts, prefixed logs, clean stop.

Used by `ctxcache serve`. Each child runs in its own process group so a stop reaches its
children too; SIGINT/SIGTERM to the supervisor stops every child, newest first (SIGTERM,
then SIGKILL after a grace period) and nothing is left behind. When the supervisor's process
dies without a stop (SIGKILL, the OOM killer), every process of the stack, children and
theirs, is SIGKILLed too (Linux: `ctxcache/reaper.py` says how; serve starts and restarts
its children from its main thread, which lives as long as the process).

A child that dies after the stack is up is restarted (`Restarts`): its process group is
killed (what it left behind, such as vLLM's engine process), then it starts again after a
backoff that doubles with each crash in a row (1 s to 30 s) and is health-gated as at
start-up. A child that crashed `max_crashes` times within `window_s` is given up: it is
reported down and the rest of the stack keeps running. The stack's state (each child's
state, pid, restarts, last exit, how long its last start took) is written to a JSON status
file after every change; the gateway reads it for `/ready` and its metrics
(`gateway/components.py`). docs/architecture.md says why this is ours and not a library.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from ctxcache.net import wait_http
from ctxcache.reaper import MARK, die_with_parent, end_reaper, start_reaper

__all__ = ["Child", "Interrupted", "Restarts", "Supervisor", "http_ready"]

log = logging.getLogger(__name__)


State = Literal["starting", "up", "restarting", "down"]


@dataclass(frozen=True)
class Restarts:
    """How a child that dies is restarted: after `backoff_s`, doubling with each crash in a
    row up to `max_backoff_s`; given up after `max_crashes` within `window_s`."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    max_crashes: int = 5
    window_s: float = 300.0


@dataclass
class Child:
    name: str
    argv: Sequence[str]
    ready: Callable[[float], None] | None = None  # blocks until up; raises TimeoutError
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 120.0
    proc: subprocess.Popen[bytes] | None = None
    # what the supervisor knows of it (the status file)
    state: State = "starting"
    since: float = field(default_factory=time.time)  # when it entered `state`
    restarts: int = 0
    last_exit: int | None = None
    start_s: float | None = None  # how long its last start took, spawn to healthy
    crashes: list[float] = field(default_factory=list)  # monotonic times, newest last
    next_start: float = 0.0  # monotonic: when a restart is due
    started_at: float = 0.0  # monotonic: the current process's spawn

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "since": round(self.since, 3),
            "pid": self.proc.pid if self.proc is not None and self.state != "down" else None,
            "restarts": self.restarts,
            "last_exit": self.last_exit,
            "start_s": None if self.start_s is None else round(self.start_s, 3),
        }


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived while the stack was starting."""


class Supervisor:
    """Use as a context manager: from entry on, SIGINT/SIGTERM request a clean stop, and
    the stack's reaper runs (holding `hold_fd`, if given, until the stack is gone)."""

    def __init__(
        self,
        *,
        out: IO[str] | None = None,
        grace_s: float = 10.0,
        restarts: Restarts | None = None,
        status_path: Path | None = None,
        hold_fd: int | None = None,
    ) -> None:
        self.children: list[Child] = []
        self.out = out or sys.stdout
        self.grace_s = grace_s
        self.restarts = restarts or Restarts()
        self.status_path = status_path
        self._lock = threading.Lock()
        self._pumps: list[threading.Thread] = []
        self.stopping = threading.Event()
        self._old_handlers: dict[int, Any] = {}
        self.stack = secrets.token_hex(16)  # every child's `MARK`: what the reaper looks for
        self._hold = () if hold_fd is None else (hold_fd,)
        self._reaper: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Supervisor:
        def on_signal(signum: int, frame: object) -> None:
            self.stopping.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, on_signal)
        self._reaper = start_reaper(self.stack, keep=self._hold)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            end_reaper(self._reaper)  # it kills what the stop left, if anything
            self._reaper = None

    def start(self, child: Child) -> Child:
        """Start a child and block until it is healthy (start-up: a failure stops here)."""
        self.children.append(child)
        self._spawn(child)
        assert child.proc is not None
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
        self._set(child, "up")
        child.start_s = time.monotonic() - child.started_at
        self._save()
        log.info("%s is up (pid %d)", child.name, child.proc.pid)
        return child

    def _spawn(self, child: Child) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env, MARK: self.stack}
        child.proc = subprocess.Popen(
            list(child.argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent(),  # SIGKILLed if we die (from the main thread only)
        )
        child.started_at = time.monotonic()
        self._set(child, "starting")
        self._pumps = [p for p in self._pumps if p.is_alive()]
        pump = threading.Thread(target=self._pump, args=(child, child.proc), daemon=True)
        self._pumps.append(pump)
        pump.start()

    def _pump(self, child: Child, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        prefix = f"{child.name:>8} | "
        with proc.stdout:  # closed at the child's EOF (it exited, its group killed)
            for raw in iter(proc.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                with self._lock:
                    if self.out.closed:  # its owner closed it: a child that outlived stop()
                        continue
                    self.out.write(prefix + line + "\n")
                    self.out.flush()

    def wait(self, poll_s: float = 0.25) -> int:
        """Block until a signal asks for a stop, restarting children that die; 0."""
        while not self.stopping.wait(poll_s):
            for child in self.children:
                if self.stopping.is_set():
                    break
                self._watch(child)
        return 0

    def _watch(self, child: Child) -> None:
        """One look at a child: notice a crash, start a restart that is due, see a
        restarted child become healthy (or not, in time)."""
        proc = child.proc
        assert proc is not None
        if child.state == "up":
            if proc.poll() is not None:
                self._crashed(child, f"exited with {proc.returncode}")
        elif child.state == "restarting":
            if time.monotonic() >= child.next_start:
                child.restarts += 1
                log.warning("restarting %s (restart %d)", child.name, child.restarts)
                self._spawn(child)
                self._save()
        elif child.state == "starting":
            if proc.poll() is not None:
                self._crashed(child, f"exited with {proc.returncode} while starting")
                return
            try:
                if child.ready is not None:
                    child.ready(0.2)
            except (TimeoutError, OSError):
                if time.monotonic() - child.started_at > child.startup_timeout:
                    self._crashed(child, f"not healthy after {child.startup_timeout}s")
                return
            child.start_s = time.monotonic() - child.started_at
            self._set(child, "up")
            self._save()
            log.info("%s is up again (pid %d, %.1f s)", child.name, proc.pid, child.start_s)

    def _crashed(self, child: Child, why: str) -> None:
        """Kill what the child left (its process group), then plan its restart or give
        it up (`max_crashes` within `window_s`)."""
        assert child.proc is not None
        _signal_group(child.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=5)
        child.last_exit = child.proc.returncode
        now, policy = time.monotonic(), self.restarts
        child.crashes = [t for t in child.crashes if now - t < policy.window_s] + [now]
        if len(child.crashes) >= policy.max_crashes:
            self._set(child, "down")
            log.error(
                "%s %s: %d crashes within %.0f s, so it is not restarted again; the rest of "
                "the stack keeps running",
                child.name,
                why,
                len(child.crashes),
                policy.window_s,
            )
        else:
            delay = min(policy.max_backoff_s, policy.backoff_s * 2 ** (len(child.crashes) - 1))
            child.next_start = now + delay
            self._set(child, "restarting")
            log.warning("%s %s; restarting it in %.1f s", child.name, why, delay)
        self._save()

    def _set(self, child: Child, state: State) -> None:
        child.state, child.since = state, time.time()

    def _save(self) -> None:
        """Write every child's status to the status file (whole, by rename)."""
        if self.status_path is None:
            return
        doc = {
            "supervisor_pid": os.getpid(),
            "updated": round(time.time(), 3),
            "components": {c.name: c.status() for c in self.children},
        }
        tmp = self.status_path.with_name(self.status_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            tmp.replace(self.status_path)
        except OSError as exc:
            log.warning("cannot write the status file %s: %s", self.status_path, exc)

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
        if self.status_path is not None:
            self.status_path.unlink(missing_ok=True)
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
