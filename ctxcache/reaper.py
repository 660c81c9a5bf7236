"""A stack's processes die with the process that started them, even by SIGKILL (Linux).

Two layers, because one does not reach far enough:

- `die_with_parent`: each child the supervisor starts asks the kernel for SIGKILL when its
  parent dies (`prctl(PR_SET_PDEATHSIG)`). It is kept across `exec`, so it holds for
  redis-server and for `ctxcache vllm`, which execs vLLM's server. It does not reach
  grandchildren: vLLM's server starts its EngineCore, which starts a worker, and
  multiprocessing's resource tracker, and all three outlive a SIGKILL of the server (seen
  with this vLLM: still running 20 s later), keeping the engine's memory and the shared KV
  region. And the kernel sends it when the *thread* that forked the child ends, so it is
  asked for only from the main thread, whose end is the process's.
- The reaper: a small process (`python -m ctxcache.reaper`, its own session) started first.
  Every process of the stack carries `CTXCACHE_STACK=<token>` in its environment (children
  inherit it, however they start: multiprocessing, setsid, fork). The reaper waits for EOF
  on its stdin, a pipe whose only writer is the supervisor's process, so EOF means that
  process ended, however it ended. It then SIGKILLs every process whose environment holds
  the token until none is left, and exits. A pid is checked and signalled through a pidfd,
  so a pid reused meanwhile is never hit. It also holds any descriptor it was given (serve
  gives it the data dir's lock, `ctxcache.in_use`) until then: the lock is free only once
  nothing of the stack is running.

SIGKILL, not SIGTERM: every component already survives a `kill -9` of its own (the fault
tests), and nothing a stopping process would do is worth a process that does not stop.
Elsewhere than Linux neither layer exists, and children outlive a serve killed by SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["MARK", "die_with_parent", "end_reaper", "marked", "start_reaper", "sweep"]

MARK = "CTXCACHE_STACK"  # in the environment of every process of a stack: its token
PR_SET_PDEATHSIG = 1
PROC = Path("/proc")


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that has the child SIGKILLed when this process dies; None where
    the kernel cannot (not Linux) or should not (off the main thread: the signal comes
    when the forking thread ends, and only the main thread lives as long as we do)."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0)
        if os.getppid() != parent:  # died before the prctl: nobody will tell us
            os._exit(1)

    return preexec


def start_reaper(token: str, keep: Sequence[int] = ()) -> subprocess.Popen[bytes] | None:
    """The reaper of the stack `token`, holding the descriptors `keep` until it is done;
    None where there is no /proc to find the stack's processes in."""
    if sys.platform != "linux" or not PROC.is_dir():
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "ctxcache.reaper", token],
        stdin=subprocess.PIPE,
        pass_fds=tuple(keep),
        # not one of an enclosing stack's processes (its reaper would kill this one first)
        env={k: v for k, v in os.environ.items() if k != MARK},
        start_new_session=True,  # not stopped by a Ctrl-C or a kill of our process group
    )


def end_reaper(reaper: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """Tell the reaper we are ending (EOF), and give it time to sweep what is left."""
    if reaper is None:
        return
    assert reaper.stdin is not None
    reaper.stdin.close()
    # past the timeout (a process that does not die: uninterruptible) it goes on alone
    with contextlib.suppress(subprocess.TimeoutExpired):
        reaper.wait(timeout=timeout_s)


def marked(token: str) -> list[int]:
    """The live processes whose environment holds `MARK=token` (those we may read)."""
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit() and _marked(p.name, token)]


def sweep(token: str, poll_s: float = 0.05) -> int:
    """SIGKILL the stack's processes until none is left (a zombie's environment reads
    empty); how many were seen."""
    seen: set[int] = set()
    while pids := marked(token):
        for pid in pids:
            seen.add(pid)
            _kill_if_marked(pid, token)
        time.sleep(poll_s)
        poll_s = min(1.0, poll_s * 2)
    return len(seen)


def _marked(pid: int | str, token: str) -> bool:
    try:
        environ = (PROC / str(pid) / "environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return False
    return f"{MARK}={token}".encode() in environ.split(b"\0")


def _kill_if_marked(pid: int, token: str) -> None:
    """Through a pidfd, which pins the process: the one checked is the one killed, even
    if `pid` ended and was reused meanwhile."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # a kernel before 5.3: a plain kill
        if _marked(pid, token):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return
    try:
        if _marked(pid, token):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def main() -> int:
    token = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.buffer.read()  # EOF: the supervisor's process has ended, or is ending
    if n := sweep(token):
        with contextlib.suppress(OSError):  # (whoever read our stderr may be gone)
            print(f"ctxcache reaper: killed {n} process(es) left running", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
