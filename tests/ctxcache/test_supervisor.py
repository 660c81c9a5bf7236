"""The supervisor's output: a child's last lines are written before `stop()` returns."""

from __future__ import annotations

import io
import sys
import threading
import time

from ctxcache.supervisor import Child, Supervisor

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
