"""The shared-memory region that holds the memory tier when an engine runs beside us.

One file in a memory-backed directory (`--local-dir`: /dev/shm, a tmpfs volume, a
Kubernetes `emptyDir: {medium: Memory}`), created by the sidecar at start, reserved whole
with `posix_fallocate` (a tmpfs that runs out while a page is first written would kill the
writer with SIGBUS; reserving up front turns that into a refusal to start), mode 0660, and
mapped by the sidecar and by every local engine. Its name carries the sidecar's
**generation** (random, new at every start), and so does its first page: an engine that
mapped an older sidecar's region can never mistake it for this one.

After the first page comes the **write table**: one record per slot handed to an engine to
write into (`claim`), cleared when that engine has said it stopped writing (`unclaim`).
It lives in the mapping, so it survives a `kill -9` of the sidecar: the next sidecar on
this directory takes the region over (`recycle_stale`) and keeps every extent listed
there out of its allocator until that writer commits, aborts or is gone
(`inherited`, docs/sidecar.md "Invariants of the local path"), whatever the sizes of the
two regions: the file only grows, so the part of an extent that lies in the new region is
kept out, and its record is kept whole in the table for the sidecars after this one.

The rest of the region is an allocator of block slots: first fit over free extents,
coalescing on free, 4 KiB aligned. A slot is a numpy array over the mapping; the slot is
given back when the last array over it goes (`weakref.finalize` on an owner that every
view of the slot keeps alive), which is exactly the memory tier's own rule — a block being
sent, copied by an engine (a lease holds a reference) or written to disk is never reused
under it, whatever the store evicted meanwhile.

The directory the region lives in is `sidecar.arena_dir`'s (whom it trusts, the names in
it, the regions an earlier sidecar left there: `recycle_stale`), and the engines'
liveness locks in it are `sidecar.arena_clients`'.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import os
import secrets
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from sidecar.arena_clients import live_clients
from sidecar.arena_dir import RegionError, ensure_directory, recycle_stale

log = logging.getLogger(__name__)

MAGIC = b"CTXKV002"  # 002: the write table follows the first page
OLD_MAGICS = (b"CTXKV001",)  # regions without a write table (taken over, table zeroed,
# only when no engine client lives: `_takeable`)
PAGE = 4096
ALIGN = 4096
# the write table: (start, size, lease, client) per slot an engine may be writing
RECORD = struct.Struct("<QQQQ")
TABLE_RECORDS = 8192  # slots in flight to writers, all engines together
TABLE_OFFSET = PAGE
HEADER_BYTES = TABLE_OFFSET + TABLE_RECORDS * RECORD.size  # the first slot starts here
# How an engine maps the region: every page at once, since a page first touched in a copy
# costs a fault (about 13k faults, ~15 ms, per 50 MB here), paid once at connect instead of
# on its loads and stores. The sidecar maps it plainly (its pages are touched by socket
# receives, which cost far more than the faults; a 4 GiB populate would add seconds to its
# start).
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def region_name(generation: str) -> str:
    return f"kv-{generation}.shm"


class _SlotOwner:
    """What a slot's arrays hang from: numpy makes every view of a view point at the first
    object that is not an array, so a view of a slot keeps this alive, and with it the slot."""

    __slots__ = ("__array_interface__", "__weakref__", "n", "region", "start")

    def __init__(self, base: np.ndarray, address: int, start: int, n: int) -> None:
        self.region = base  # the region's bytes, mapped (kept while any view lives)
        self.start, self.n = start, n  # where the slot lies in the region
        self.__array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "data": (address + start, False),
            "version": 3,
        }


class Arena:
    """A shared-memory region and the allocator of its slots. Thread-safe."""

    def __init__(self, directory: Path, size: int) -> None:
        self.generation = secrets.token_hex(8)
        self.directory = directory
        self.path = directory / region_name(self.generation)
        self.size = round_up(max(size, ALIGN), ALIGN) + HEADER_BYTES
        ensure_directory(directory)
        # callers first make sure no live sidecar uses `directory` (`sidecar.local.claim_directory`)
        fd = recycle_stale(directory, self.path)
        if fd >= 0 and not _takeable(fd, directory):
            log.warning(
                "not reusing the previous region (another format, engines alive: where they "
                "write is unknown); a new file in %s, room for both until they let go",
                directory,
            )
            os.close(fd)
            self.path.unlink(missing_ok=True)
            fd = -1
        # the bytes of the file taken over: every mapping of it, ever, lay within them (a
        # region file only grows, `posix_fallocate`, however its sidecars were sized)
        found = os.fstat(fd).st_size if fd >= 0 else 0
        if fd < 0:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o660)
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
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._address = int(self._bytes.ctypes.data)  # (a mapping never moves)
        self._lock = threading.Lock()
        # free extents as two parallel sorted lists: starts and sizes
        self._starts: list[int] = [HEADER_BYTES]
        self._sizes: list[int] = [self.size - HEADER_BYTES]
        self.used = 0
        self.slots = 0
        # the write table: which record holds what; the leases of an earlier generation
        # whose writers may still write (lease -> client, extents), kept out of the allocator
        self._records: dict[int, list[int]] = {}
        self._free_records = list(range(TABLE_RECORDS - 1, -1, -1))
        self.inherited: dict[int, tuple[int, list[tuple[int, int]]]] = {}
        self._take_over_table(found)
        self._map[: len(MAGIC)] = MAGIC
        gen = self.generation.encode()
        self._map[len(MAGIC) : len(MAGIC) + len(gen)] = gen
        log.info("shared KV region %s: %d bytes", self.path, self.size)

    # ---- slots ----------------------------------------------------------------------
    def alloc(self, n: int) -> np.ndarray | None:
        """A slot of `n` bytes (a uint8 array over the region), or None when no free
        extent is large enough. Its bytes are whatever was there: the caller writes them."""
        need = round_up(max(n, 1), ALIGN)
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
        owner = _SlotOwner(self._bytes, self._address, start, n)
        weakref.finalize(owner, self._free, start, need)
        return np.asarray(owner)

    def offset(self, slot: np.ndarray) -> int | None:
        """Where `slot` (or any array over this region) starts in it; None if elsewhere."""
        owner = slot.base
        if (
            type(owner) is _SlotOwner
            and owner.region is self._bytes
            and slot.ndim == 1
            and slot.nbytes == owner.n
            and slot.strides[0] == slot.itemsize
        ):
            return owner.start  # a slot, whole: its bytes are all of its owner's, in order
        at = int(slot.ctypes.data) - self._address  # (`ctypes` costs a microsecond)
        return at if 0 <= at < self.size else None

    def place(self, data: object) -> int | None:
        """`offset(data)` if `data` is an array over this region (a block's slot), else None."""
        return self.offset(data) if isinstance(data, np.ndarray) else None

    def holds(self, data: object) -> bool:
        return self.place(data) is not None

    @property
    def capacity(self) -> int:
        """The bytes slots can take (the region less its header and write table)."""
        return self.size - HEADER_BYTES

    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes)

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

    def _reserve(self, start: int, size: int) -> list[tuple[int, int]]:
        """Take out of the free extents whatever of [start, start + size) they hold (an
        inherited write): the pieces taken, which `end_inherited` frees. What lies past
        this region's end (an extent of a larger region, the same file) or is taken
        already is not this call's: nothing of it is ever handed out here."""
        end = start + size
        taken: list[tuple[int, int]] = []
        with self._lock:
            i = max(0, bisect.bisect_right(self._starts, start) - 1)
            while i < len(self._starts) and self._starts[i] < end:
                first, total = self._starts[i], self._sizes[i]
                lo, hi = max(first, start), min(first + total, end)
                if lo >= hi:
                    i += 1
                    continue
                del self._starts[i], self._sizes[i]
                for s, n in ((first, lo - first), (hi, first + total - hi)):
                    if n:
                        self._starts.insert(i, s)
                        self._sizes.insert(i, n)
                        i += 1
                taken.append((lo, hi - lo))
            self.used += sum(n for _, n in taken)
            self.slots += len(taken)
        return taken

    def largest_free(self) -> int:
        with self._lock:
            return max(self._sizes, default=0)

    # ---- the write table ------------------------------------------------------------
    def claim(self, lease: int, client: int, slots: list[Any]) -> bool:
        """Record that `client` may write `slots` under `lease` (before it learns where they
        are); False when the table is full (the caller refuses the allocation)."""
        with self._lock:
            if len(self._free_records) < len(slots):
                return False
            taken = [self._free_records.pop() for _ in slots]
            for rec, slot in zip(taken, slots, strict=True):
                start = self.offset(slot)
                assert start is not None  # (slots of this region, from `alloc`)
                size = round_up(max(len(slot), 1), ALIGN)
                RECORD.pack_into(
                    self._map, TABLE_OFFSET + rec * RECORD.size, start, size, lease, client
                )
            self._records[lease] = taken
        return True

    def unclaim(self, lease: int) -> None:
        """`lease`'s writer has stopped writing (a commit, an abort, its process gone)."""
        with self._lock:
            for rec in self._records.pop(lease, []):
                RECORD.pack_into(self._map, TABLE_OFFSET + rec * RECORD.size, 0, 0, 0, 0)
                self._free_records.append(rec)

    def end_inherited(self, lease: int) -> bool:
        """An earlier generation's write is over: its extents return to the allocator."""
        got = self.inherited.pop(lease, None)
        if got is None:
            return False
        self.unclaim(lease)
        for start, size in got[1]:
            self._free(start, size)
        return True

    def _take_over_table(self, found: int) -> None:
        """Read the write table this file had (a region taken over from an earlier
        sidecar; `found`: the file's bytes then): every extent some engine may still be
        writing stays out of the allocator — the part of it that lies in this region, which
        may be smaller or larger than the one the extent was given in — under its lease,
        until that writer is done. Its record stays in the table whole, so the next sidecar,
        of whatever size, keeps it out too, until the writer is done (docs/sidecar.md,
        "Invariants of the local path": region size changes). A record that no writer can
        hold (outside the file, unaligned, no lease) is cleared; a kept one is never
        rewritten, so a sidecar killed while it takes the table over leaves it whole."""
        if bytes(self._map[: len(MAGIC)]) != MAGIC:  # no table: never headed, another format
            self._map[TABLE_OFFSET:HEADER_BYTES] = bytes(HEADER_BYTES - TABLE_OFFSET)
            return
        records = []
        for rec in range(TABLE_RECORDS):
            at = TABLE_OFFSET + rec * RECORD.size
            start, size, lease, client = RECORD.unpack_from(self._map, at)
            if start or size or lease:
                records.append((start, size, lease, client, rec))
        kept, beyond = set(), 0
        for start, size, lease, client, rec in sorted(records):
            valid = (
                start >= HEADER_BYTES
                and start % ALIGN == 0
                and size > 0
                and size % ALIGN == 0
                and start + size <= found
                and lease
            )
            if not valid:
                log.warning("ignoring a malformed write-table record in %s", self.path)
                RECORD.pack_into(self._map, TABLE_OFFSET + rec * RECORD.size, 0, 0, 0, 0)
                continue
            kept.add(rec)
            self._records.setdefault(lease, []).append(rec)
            held = self.inherited.setdefault(lease, (client, []))
            held[1].extend(self._reserve(start, size))
            beyond += start + size > self.size
        self._free_records = [r for r in self._free_records if r not in kept]
        if self.inherited:
            log.warning(
                "the earlier sidecar's engines may still be writing %d slots of %s (%d of "
                "them past this region's end, in the larger file): kept until they commit, "
                "abort or exit",
                len(kept),
                self.path.name,
                beyond,
            )

    def close(self, keep: bool = False) -> None:
        """Remove the file, unless `keep` (engines still map it: removing it would free no
        memory until they let go, and the next sidecar on this directory reuses the file,
        `recycle_stale`). The mapping stays until the process ends (slots may still be
        referenced by threads that are finishing), so this never invalidates a view."""
        if keep:
            log.info("leaving the region %s to the next sidecar: engines map it", self.path)
            return
        self.path.unlink(missing_ok=True)


def _takeable(fd: int, directory: Path) -> bool:
    """Whether a previous sidecar's region file can become this one's: one of this format
    (its write table says what its writers hold), one never headed (no engine had it), or
    one no engine client can be writing (none alive). Not one of another format (an older
    or newer ctxcache) while engines live: its writers' slots are unknown and may lie
    anywhere, this format's write table included."""
    head = os.pread(fd, len(MAGIC), 0)
    if head == MAGIC or not head.strip(b"\0"):
        return True
    return live_clients(directory) == 0


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


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to
