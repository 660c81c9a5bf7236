"""The directory the shared region lives in (`--local-dir`, `sidecar.arena`), as the
sidecar sees it: the names it makes there (`SOCKET_NAME`, `DIR_LOCK`), whom it trusts, and
the regions an earlier sidecar left there.

**The directory is trusted only if only we can change it** (`check_directory`): nobody
else may write to it (a sticky one of ours is allowed), region files are opened with
`O_NOFOLLOW`, and only regular files we own are taken over (`open_own_regular`,
`recycle_stale`: the region a previous sidecar left becomes the new one's, the same file).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("sidecar.arena")  # the region's records keep one logger name

SOCKET_NAME = "sidecar.sock"
DIR_LOCK = "sidecar.lock"


class RegionError(RuntimeError):
    """The region could not be created (no room in the directory, no permission, a
    directory that others can write)."""


def ensure_directory(directory: Path) -> None:
    """Create `directory` if it is missing (0770: the engine, of our group, makes its lock
    file there; in a Kubernetes `emptyDir`, which is 0777, give a subdirectory), then
    `check_directory`."""
    if not directory.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(directory, 0o770)
    check_directory(directory)


def check_directory(directory: Path) -> None:
    """Refuse a directory that someone else could plant files in (a region, a socket, a
    lock): one that others may write, unless it is sticky (others cannot rename or remove
    our files there) and owned by us or root (like /dev/shm)."""
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise RegionError(f"{directory} is not a directory")
    if info.st_mode & stat.S_IWOTH:
        sticky = info.st_mode & stat.S_ISVTX
        if not sticky or info.st_uid not in (os.geteuid(), 0):
            raise RegionError(
                f"{directory} is writable by every user (mode {stat.S_IMODE(info.st_mode):o}); "
                "give the sidecar a directory only it and its engines can write "
                "(docs/sidecar.md)"
            )


def open_own_regular(path: Path, flags: int) -> int:
    """Open `path` without following a symlink; only a regular file owned by us. -1 if it
    is anything else (it is then left alone)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return -1
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        return -1
    return fd


def recycle_stale(directory: Path, path: Path) -> int:
    """The region a previous sidecar left (a restart, a kill -9) becomes this one's: renamed
    to `path`, the same file, so the same memory. An engine keeps mapping the old region
    until it next talks to us, and a tmpfs frees a removed file's pages only once nobody
    maps them: a fresh file would need the room twice, and a volume sized for one region
    (compose's, a Kubernetes `emptyDir` with a `sizeLimit`) would refuse it. Nothing is
    read from it as ours but its write table: the new generation is written into its first
    page, and a lease of the old generation ends in a failed release (a miss). Only a
    regular file of ours is taken (a symlink or another user's file is left alone); other
    stale regions of ours are removed. Returns the taken file's descriptor, or -1."""
    stale = []
    for old in directory.glob("kv-*.shm"):
        fd = open_own_regular(old, os.O_RDWR)
        if fd < 0:
            log.warning("not taking over %s: not a regular file of this user", old)
            continue
        stale.append((os.fstat(fd).st_size, old, fd))
    stale.sort(key=lambda s: s[0], reverse=True)  # the largest is kept: it may need no more room
    taken = -1
    for i, (_, old, fd) in enumerate(stale):
        if i == 0:
            log.info("reusing a previous sidecar's region %s as %s", old.name, path.name)
            os.rename(old, path)
            taken = fd
            continue
        log.info("removing a previous sidecar's region %s", old)
        os.close(fd)
        old.unlink(missing_ok=True)
    return taken
