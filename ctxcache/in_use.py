"""Whether a data dir, or a directory of it, is in use, before serve removes anything.

`lock_data_dir`: one `ctxcache serve` per data dir. It holds an `flock` on
`<data-dir>/serve.lock` (its pid inside) for its life, shared with its reaper
(`ctxcache/reaper.py`), which lets go only once every process of the stack is gone. So a
serve that takes the lock knows no earlier stack runs on the data dir, and may remove what
that one left (its shared KV directory); one that cannot take it refuses to start, naming
the other serve's pid. The kernel releases the lock of a process that died, so a stale lock
is simply taken.

`users`: the processes that have a file under a directory open or mapped (Linux, those this
user may inspect), checked before the shared KV directory is removed: a stack started by an
older serve (no lock), or a process that outlived its reaper, keeps it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

__all__ = ["LOCK_FILE", "InUse", "lock_data_dir", "users"]

LOCK_FILE = "serve.lock"
PROC = Path("/proc")


class InUse(RuntimeError):
    """Someone else's processes use the data dir, or a directory in it."""


def lock_data_dir(data: Path, wait_s: float = 15.0) -> int:
    """Hold `data` for this process (and whoever it passes the descriptor to); InUse when a
    live serve holds it. A serve that ended while its stack is still being killed is waited
    for, up to `wait_s`. Returns the descriptor to keep open."""
    path = data / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _holder(path)  # (None for a moment: it has yet to write its pid)
            if (holder is not None and _alive(holder)) or time.monotonic() > deadline:
                os.close(fd)
                raise InUse(_in_use_message(data, holder)) from None
            time.sleep(0.1)  # its serve is gone; its reaper is still at work
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _in_use_message(data: Path, holder: int | None) -> str:
    who = "another ctxcache serve" if holder is None else f"ctxcache serve (pid {holder})"
    if holder is not None and not _alive(holder):
        return (
            f"{data} is still in use by the processes of {who}, which has ended; they are "
            "being stopped: try again in a moment"
        )
    return f"{data} is in use by {who}: stop it first, or give this one another --data-dir"


def _holder(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return None


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def users(directory: Path) -> set[int]:
    """The processes (those this user may inspect, on Linux) with `directory`, or anything
    under it, open, mapped or as their working directory. Empty where there is no /proc."""
    root = str(directory)
    found: set[int] = set()
    if not PROC.is_dir():
        return found
    for proc in PROC.iterdir():
        if proc.name.isdigit() and any(
            p == root or p.startswith(root + "/") for p in _files_of(proc)
        ):
            found.add(int(proc.name))
    return found


def _files_of(proc: Path) -> list[str]:
    """The paths a process has open (descriptors, working directory) and mapped."""
    paths = []
    with contextlib.suppress(OSError):  # not ours to inspect, or gone
        for fd in os.listdir(proc / "fd"):
            with contextlib.suppress(OSError):  # closed meanwhile
                paths.append(os.readlink(proc / "fd" / fd))
    with contextlib.suppress(OSError):
        paths.append(os.readlink(proc / "cwd"))
    with contextlib.suppress(OSError):
        for line in (proc / "maps").read_text().splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                paths.append(fields[5])
    return [p.removesuffix(" (deleted)") for p in paths]
