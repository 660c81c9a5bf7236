"""Where `ctxcache serve` puts the sidecar's shared KV region: a private directory under
/dev/shm, else under the data dir, else none (KV over lm:// only); recorded under the data
dir so the next start removes what a killed serve left (docs/deploy.md, "Shared-memory KV
path")."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from ctxcache.in_use import InUse, users

log = logging.getLogger("ctxcache.serve")  # (serve's: these lines are part of its start-up)

SHM = Path("/dev/shm")
LOCAL_PREFIX = "ctxcache-"
LOCAL_RECORD = "local-kv-dir"  # under the data dir: where this stack's region lives
REGION_SLACK = 1 << 20  # the region's header page, rounding, the socket


def region_bytes(args: argparse.Namespace) -> int:
    """The sidecar's shared region: its memory tier plus an eighth (the sidecar's default
    for `--local-bytes`, passed explicitly so this directory's room is checked for it)."""
    memory: int = args.sidecar_memory_bytes
    return memory + memory // 8


def local_kv_dir(data: Path, size: int, shm: Path | None = None) -> Path | None:
    """A private directory (0700) for the sidecar's region of `size` bytes and its socket:
    under `shm` (/dev/shm, memory) where that is writable and has room, else
    `<data>/local`; None (KV over lm:// only) where neither can hold it. Its path is
    recorded under the data dir, so a serve that was killed has its region removed on the
    next start.

    `<data>/local` is on disk: the page cache writes the region back there, in the clear,
    so it is not used when the sidecar has a disk-tier key (`CTX_SIDECAR_ENCRYPTION_KEY`),
    nor where the sidecar cannot reserve a region (no `posix_fallocate`: macOS).
    """
    shm = shm or SHM
    remove_local_kv_dir(data, shm)
    need = size + REGION_SLACK
    path: Path | None = None
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) and _room(shm) >= need:
        try:
            path = Path(tempfile.mkdtemp(prefix=LOCAL_PREFIX, dir=shm))  # mode 0700
        except OSError as exc:
            log.warning("no directory in %s for the shared KV region: %s", shm, exc)
    if path is None:
        if why := _no_region_on_disk(data, need):
            log.warning("no shared KV region (%s): KV moves over lm:// only", why)
            return None
        path = data / "local"
        path.mkdir(mode=0o700)
        path.chmod(0o700)  # whatever the umask
    (data / LOCAL_RECORD).write_text(f"{path}\n")
    log.info("shared-memory KV path: a %d MiB region in %s", size >> 20, path)
    return path


def _no_region_on_disk(data: Path, need: int) -> str | None:
    """Why the region may not go under the data dir, if it may not."""
    if not hasattr(os, "posix_fallocate"):
        return "the sidecar cannot reserve one on this system"
    if os.environ.get("CTX_SIDECAR_ENCRYPTION_KEY"):
        return "the disk tier is encrypted, and no memory-backed directory was found"
    if _room(data) < need:
        return f"no room for {need >> 20} MiB in /dev/shm or {data}"
    return None


def remove_local_kv_dir(data: Path, shm: Path | None = None, wait_s: float = 0.0) -> None:
    """Remove the region directory recorded under the data dir, if it is one serve makes
    (`<shm>/ctxcache-*`, `<data>/local`), and the record; InUse, removing nothing, while a
    process has a file in it open or mapped after `wait_s` (a stack an older serve started,
    which took no lock on the data dir; at a stop, a process still exiting)."""
    record = data / LOCAL_RECORD
    try:
        path = Path(record.read_text().strip())
    except OSError:
        path = data / "local"
    ours = [data / "local"]
    if path.parent == (shm or SHM) and path.name.startswith(LOCAL_PREFIX):
        ours.append(path)
    deadline = time.monotonic() + wait_s
    for directory in ours:
        while directory.exists() and (pids := users(directory)):
            if time.monotonic() >= deadline:
                raise InUse(f"the shared KV directory {directory} is in use by pids {sorted(pids)}")
            time.sleep(0.1)
    for directory in ours:
        shutil.rmtree(directory, ignore_errors=True)
    record.unlink(missing_ok=True)


def _room(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0
