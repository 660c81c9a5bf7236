"""The supervisor: a child's last lines are written before `stop()` returns; a child that
dies is restarted, one that keeps dying is given up, and the status file says so."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctxcache.supervisor import Child, Restarts, Supervisor

# prints a line, and on SIGTERM its last words as it exits
CHILD = """
import signal, sys, time
def bye(*_):
    sys.stdout.write("".join(f"last words {i}\\\\n" for i in range(100)))
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print("up", flush=True)
while True:
    time.sleep(0.1)
"""


class SlowLog(io.StringIO):
    """A log that takes its time (a slow disk): each write 3 ms; keeps what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def write(self, s: str) -> int:
        time.sleep(0.003)
        self.lines.append(s)
        return len(s)


def test_a_childs_last_lines_are_written_before_stop_returns() -> None:
    out = SlowLog()
    errors: list[BaseException | None] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda a: errors.append(a.exc_value)  # a pump's own exception
    try:
        with Supervisor(out=out, grace_s=5.0) as sup:

            def ready(timeout: float) -> None:
                if not any("up" in line for line in out.lines):
                    time.sleep(0.05)
                    raise TimeoutError

            sup.start(Child("talker", [sys.executable, "-c", CHILD], ready=ready))
        # stop() has returned: the owner of `out` closes it now, as a benchmark closes its
        # servers' log once its stack is down
        written = len(out.lines)
        out.close()
        time.sleep(0.5)  # a pump still running would write to the closed log now
    finally:
        threading.excepthook = old_hook
    assert any("last words 99" in line for line in out.lines[:written]), out.lines[-3:]
    assert not errors, errors


SLEEPER = "import time; print('up', flush=True); time.sleep(600)"
CRASHER = "import sys; print('up', flush=True); sys.exit(3)"


def status(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["components"]


def until(check: Callable[[], bool], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.05)


def test_a_child_that_dies_is_restarted_and_one_that_keeps_dying_is_given_up(
    tmp_path: Path,
) -> None:
    """kill -9 of a healthy child: its group is killed, it restarts after its backoff and is
    up again (the status file says so, with the restart counted). A child that exits each
    time it starts is given up after `max_crashes`; the other child is unaffected; a stop
    then ends everything and removes the status file."""
    path = tmp_path / "components.json"
    policy = Restarts(backoff_s=0.1, max_backoff_s=0.4, max_crashes=3, window_s=60)
    with Supervisor(out=io.StringIO(), restarts=policy, status_path=path) as sup:
        steady = sup.start(Child("steady", [sys.executable, "-c", SLEEPER]))
        flaky = sup.start(Child("flaky", [sys.executable, "-c", SLEEPER]))
        assert {c["state"] for c in status(path).values()} == {"up"}
        watcher = threading.Thread(target=sup.wait, kwargs={"poll_s": 0.05})
        watcher.start()
        try:
            assert flaky.proc is not None
            first = flaky.proc.pid
            os.kill(first, signal.SIGKILL)
            until(lambda: status(path)["flaky"]["restarts"] == 1)
            until(lambda: status(path)["flaky"]["state"] == "up")
            now = status(path)["flaky"]
            assert now["pid"] != first and now["last_exit"] == -signal.SIGKILL
            assert alive(now["pid"]) and not alive(first)

            # from now on it dies at each start: crashes 2 and 3 (within the window) give it up
            flaky.argv = [sys.executable, "-c", CRASHER]
            assert flaky.proc is not None
            os.kill(flaky.proc.pid, signal.SIGKILL)
            until(lambda: status(path)["flaky"]["state"] == "down")
            assert status(path)["flaky"] == {**status(path)["flaky"], "pid": None, "restarts": 2}
            time.sleep(0.5)  # no more restarts once given up
            assert status(path)["flaky"]["restarts"] == 2
            assert status(path)["steady"]["state"] == "up"
            assert steady.proc is not None and steady.proc.poll() is None
        finally:
            sup.stopping.set()
            watcher.join(timeout=10)
    assert steady.proc.poll() is not None
    assert not path.exists()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# a supervisor in a process of its own (killed by the test), with one child that starts a
# grandchild in a session of its own, as vLLM's server starts its EngineCore, beyond the
# child's process group; each prints its pid
STACK = """
import subprocess, sys
from ctxcache.supervisor import Child, Supervisor
GRANDCHILD = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"
CHILD = f'''
import os, subprocess, sys, time
print(os.getpid(), flush=True)
subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}], start_new_session=True)
time.sleep(600)
'''
with Supervisor() as sup:
    sup.start(Child("child", [sys.executable, "-c", CHILD]))
    sup.wait()
"""


def test_a_killed_supervisors_children_and_theirs_are_killed_too(tmp_path: Path) -> None:
    """kill -9 of the supervisor's process: its child (parent-death signal) and the
    grandchild that left the child's session (the reaper) are gone within seconds."""
    out = tmp_path / "stack.log"
    with out.open("w") as log, (tmp_path / "stack.err").open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", STACK], stdout=log, stderr=err, start_new_session=True
        )
    pids: set[int] = set()
    try:
        until(lambda: len(pids_in(out)) == 2)
        pids = pids_in(out)
        assert all(alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        until(lambda: not any(alive(p) for p in pids), within_s=15)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def pids_in(log: Path) -> set[int]:
    return {int(w) for w in log.read_text().split() if w.isdigit()}
