"""Engines' liveness, which travels through the region's directory (`sidecar.arena_dir`):
an engine's client holds an `flock` on `client-<token>.lock` for its life
(`take_client_lock`); the kernel lets go of it when the process dies, whatever its PID
namespace, so the sidecar can tell a dead writer from a slow one (`client_alive`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
from pathlib import Path

log = logging.getLogger("sidecar.arena")  # the region's records keep one logger name

CLIENT_LOCK = re.compile(r"client-([0-9a-f]{16})\.lock")


def client_lock_path(directory: Path, token: str) -> Path:
    return directory / f"client-{token}.lock"


def take_client_lock(directory: Path, token: str) -> int:
    """(An engine's client.) Hold `client-<token>.lock` for this process's life: made
    under a temporary name, locked, then renamed, so the sidecar never sees it unlocked
    while we live. -1 when the directory does not let us (the sidecar then cannot tell
    our death from silence: see `client_alive`)."""
    tmp = directory / f".client-{token}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o660)
    except OSError as exc:
        log.warning(
            "no liveness lock in %s (%s): stores there are freed only by timeout", directory, exc
        )
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, client_lock_path(directory, token))
    except OSError:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        return -1
    return fd


def drop_client_lock(directory: Path, token: str, fd: int) -> None:
    if fd >= 0:
        client_lock_path(directory, token).unlink(missing_ok=True)
        os.close(fd)


def client_alive(directory: Path, token: str) -> bool | None:
    """Whether the engine client `token` lives: its lock file is held (True), left
    unlocked by a dead process (False: the file is removed), or absent (None: unknown)."""
    path = client_lock_path(directory, token)
    fd = open_own_or_group(path)
    if fd < 0:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    else:
        with contextlib.suppress(OSError):
            path.unlink()
        return False
    finally:
        os.close(fd)


def live_clients(directory: Path) -> int:
    """How many engine clients with a lock in `directory` are alive."""
    alive = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            m = CLIENT_LOCK.fullmatch(entry.name)
            if m and client_alive(directory, m.group(1)):
                alive += 1
    return alive


def open_own_or_group(path: Path) -> int:
    """Open a lock file an engine made (it may run as another user of our group): a
    regular file, never through a symlink. -1 otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return -1
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return -1
    return fd
