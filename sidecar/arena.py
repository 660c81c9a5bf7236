"""The shared-memory region that holds the memory tier when an engine runs beside us.

One file in a memory-backed directory (`--local-dir`: /dev/shm, a tmpfs volume, a
Kubernetes `emptyDir: {medium: Memory}`), created by the sidecar at start, reserved whole
with `posix_fallocate` (a tmpfs that runs out while a page is first written would kill the
writer with SIGBUS; reserving up front turns that into a refusal to start), mode 0660, and
mapped by the sidecar and by every local engine. Its name carries the sidecar's
**generation** (random, new at every start), and so does its first page: an engine that
mapped an older sidecar's region can never mistake it for this one.

The rest of the region is an allocator of block slots: first fit over free extents,
coalescing on free, 4 KiB aligned. A slot is a numpy array over the mapping; the slot is
given back when its last reference goes (`weakref.finalize`), which is exactly the
memory tier's own rule — a block being sent, copied by an engine (a lease holds a
reference) or written to disk is never reused under it, whatever the store evicted meanwhile.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import mmap
import os
import secrets
import threading
import weakref
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"CTXKV001"
HEADER_BYTES = 4096  # magic, generation; the first slot starts after it
ALIGN = 4096
SOCKET_NAME = "sidecar.sock"
# How an engine maps the region: every page at once, since a page first touched in a copy
# costs a fault (about 13k faults, ~15 ms, per 50 MB here), paid once at connect instead of
# on its loads and stores. The sidecar maps it plainly (its pages are touched by socket
# receives, which cost far more than the faults; a 4 GiB populate would add seconds to its
# start).
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def region_name(generation: str) -> str:
    return f"kv-{generation}.shm"


class RegionError(RuntimeError):
    """The region could not be created (no room in the directory, no permission)."""


class Arena:
    """A shared-memory region and the allocator of its slots. Thread-safe."""

    def __init__(self, directory: Path, size: int) -> None:
        self.generation = secrets.token_hex(8)
        self.directory = directory
        self.path = directory / region_name(self.generation)
        self.size = _round_up(max(size, ALIGN), ALIGN) + HEADER_BYTES
        directory.mkdir(parents=True, exist_ok=True)
        # callers first make sure no live sidecar uses `directory`
        fd = -1
        if _recycle_stale(directory, self.path):
            try:
                fd = os.open(self.path, os.O_RDWR)
            except PermissionError:  # another user's (a sidecar run as root before): a new one
                self.path.unlink(missing_ok=True)
        if fd < 0:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.fchmod(fd, 0o660)  # not narrowed by the umask: the engine may be another uid
            try:
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                raise RegionError(
                    f"{directory} cannot hold a {self.size}-byte KV region ({exc.strerror}); "
                    "size the memory-backed volume for the memory tier (docs/deploy.md)"
                ) from exc
            self._map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self._map[: len(MAGIC)] = MAGIC
        gen = self.generation.encode()
        self._map[len(MAGIC) : len(MAGIC) + len(gen)] = gen
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._lock = threading.Lock()
        # free extents as two parallel sorted lists: starts and sizes
        self._starts: list[int] = [HEADER_BYTES]
        self._sizes: list[int] = [self.size - HEADER_BYTES]
        self.used = 0
        self.slots = 0
        log.info("shared KV region %s: %d bytes", self.path, self.size)

    # ---- slots ----------------------------------------------------------------------
    def alloc(self, n: int) -> np.ndarray | None:
        """A slot of `n` bytes (a uint8 array over the region), or None when no free
        extent is large enough. Its bytes are whatever was there: the caller writes them."""
        need = _round_up(max(n, 1), ALIGN)
        with self._lock:
            for i, size in enumerate(self._sizes):
                if size >= need:
                    start = self._starts[i]
                    if size == need:
                        del self._starts[i], self._sizes[i]
                    else:
                        self._starts[i] += need
                        self._sizes[i] -= need
                    self.used += need
                    self.slots += 1
                    break
            else:
                return None
        slot = self._bytes[start : start + n]
        weakref.finalize(slot, self._free, start, need)
        return slot

    def offset(self, slot: np.ndarray) -> int | None:
        """Where `slot` (or any array over this region) starts in it; None if elsewhere."""
        at = int(slot.ctypes.data) - int(self._bytes.ctypes.data)
        return at if 0 <= at < self.size else None

    def holds(self, data: object) -> bool:
        return isinstance(data, np.ndarray) and self.offset(data) is not None

    def _free(self, start: int, size: int) -> None:
        with self._lock:
            self.used -= size
            self.slots -= 1
            i = bisect.bisect_left(self._starts, start)
            # merge with the next extent, then with the previous one
            if i < len(self._starts) and start + size == self._starts[i]:
                size += self._sizes[i]
                del self._starts[i], self._sizes[i]
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start:
                self._sizes[i - 1] += size
            else:
                self._starts.insert(i, start)
                self._sizes.insert(i, size)

    def largest_free(self) -> int:
        with self._lock:
            return max(self._sizes, default=0)

    def close(self, keep: bool = False) -> None:
        """Remove the file, unless `keep` (engines still map it: removing it would free no
        memory until they let go, and the next sidecar on this directory reuses the file,
        `_recycle_stale`). The mapping stays until the process ends (slots may still be
        referenced by threads that are finishing), so this never invalidates a view."""
        if keep:
            log.info("leaving the region %s to the next sidecar: engines map it", self.path)
            return
        self.path.unlink(missing_ok=True)


def read_generation(path: Path) -> str | None:
    """The generation written in a region file's first page (None: not a region)."""
    try:
        with path.open("rb") as f:
            head = f.read(len(MAGIC) + 16)
    except OSError:
        return None
    if not head.startswith(MAGIC):
        return None
    return head[len(MAGIC) :].decode(errors="replace")


def _recycle_stale(directory: Path, path: Path) -> bool:
    """The region a previous sidecar left (a restart, a kill -9) becomes this one's: renamed
    to `path`, the same file, so the same memory. An engine keeps mapping the old region
    until it next talks to us, and a tmpfs frees a removed file's pages only once nobody
    maps them: a fresh file would need the room twice, and a volume sized for one region
    (compose's, a Kubernetes `emptyDir` with a `sizeLimit`) would refuse it. Nothing is
    read from it as ours: the new generation is written into its first page, and a lease
    of the old generation ends in a failed release (a miss). Any other stale region is
    removed. True if one was recycled."""
    stale = []
    for old in directory.glob("kv-*.shm"):
        with contextlib.suppress(OSError):
            stale.append((old.stat().st_size, old))
    stale.sort(reverse=True)  # the largest is kept: it may need no more room at all
    for i, (_, old) in enumerate(stale):
        if i == 0:
            log.info("reusing a previous sidecar's region %s as %s", old.name, path.name)
            os.rename(old, path)
        else:
            log.info("removing a previous sidecar's region %s", old)
            old.unlink(missing_ok=True)
    return bool(stale)


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
