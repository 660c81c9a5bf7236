"""The store's disk side (`DiskWriter`, owned by `sidecar.store.BlockStore` and given its
index, lock, disk tier, pins and metrics): the work a locked section leaves for after the
lock (`finish`: spills written, files deleted), the start-up scan of the disk tier
(`load_disk`), the copies of blocks that stay in memory — `flush` at a clean shutdown,
`write_behind` every few seconds for pinned KV — and a corrupt block found by a read
(`drop_corrupt`). The files themselves are `sidecar.disk`'s; the index they update is
`sidecar.store_tiers`' `TierIndex`, under the store's lock.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from sidecar.blocks import Buffer, Entry, Work
from sidecar.disk import CorruptBlock, DiskTier
from sidecar.metrics import SidecarMetrics
from sidecar.sessions import PinTable
from sidecar.store_tiers import TierIndex

log = logging.getLogger("sidecar.store")  # the store's records keep one logger name


class DiskWriter:
    """Disk reads and writes of `BlockStore`, outside its lock (taken for the index)."""

    def __init__(
        self,
        *,
        index: TierIndex,
        lock: threading.Lock,
        disk: DiskTier | None,
        pins: PinTable,
        metrics: SidecarMetrics,
    ) -> None:
        self._index = index
        self._lock = lock
        self._disk = disk
        self._pins = pins
        self._metrics = metrics

    # ---- start-up -------------------------------------------------------------------
    def load_disk(self) -> int:
        """Index the blocks the disk tier holds from a previous run; returns how many."""
        if self._disk is None:
            return 0
        work = Work()
        with self._lock:
            for found in self._disk.scan():
                old = self._index.blocks.get(found.meta.key)
                if old is not None:  # an older copy of the same key: keep the newest
                    self._index.unlink(old, work)
                stored = found.payload_length if found.packed else None
                footprint = self._index.footprint(found.meta, stored)
                e = Entry(found.meta, found.meta.session, footprint=footprint)
                e.packed = found.packed
                e.pinned = self._pins.is_pinned(e.session)
                self._index.index_found(e, found.path)
            self._index.fit_disk(work)
            blocks, used = len(self._index.blocks), self._index.disk_used
        self.finish(work)
        log.info("disk tier: %d blocks, %d bytes", blocks, used)
        return blocks

    # ---- copies of blocks in memory -------------------------------------------------
    def flush(self) -> int:
        """Write every memory-only block to the disk tier (clean shutdown), pinned ones
        first, most recently used first, making room as a spill does; returns how many."""
        with self._lock:
            mem = self._index.mem_lru
            pending = [*reversed(mem[True].values()), *reversed(mem[False].values())]
        return self._copy_to_disk(pending, evict=True)[0]

    def write_behind(self, max_bytes: int | None = None) -> int:
        """Give memory-only pinned blocks a disk copy, oldest first, so that a session's KV
        survives a crash of the process; they stay in memory. Only free disk room is used:
        nothing is evicted for a copy, and it stops at the first block that does not fit
        (or once `max_bytes` are written). Returns how many blocks it wrote."""
        with self._lock:
            pending = list(self._index.mem_lru[True].values())
        blocks, nbytes = self._copy_to_disk(pending, evict=False, max_bytes=max_bytes)
        if blocks:
            self._metrics.write_behind_blocks.inc(blocks)
            self._metrics.write_behind_bytes.inc(nbytes)
            log.debug("write-behind: %d pinned blocks, %d bytes", blocks, nbytes)
        return blocks

    # ---- work done outside the lock -------------------------------------------------
    def _copy_to_disk(
        self, pending: list[Entry], *, evict: bool, max_bytes: int | None = None
    ) -> tuple[int, int]:
        """Write the blocks of `pending` that are still memory-only to the disk tier, one
        at a time, keeping them in memory; returns (blocks, bytes) written. With `evict`,
        room is made as for a spill and a block that finds none is skipped; without, only
        free room is used and the first block that finds none ends it."""
        if self._disk is None:
            return 0, 0
        blocks = nbytes = 0
        for e in pending:
            if max_bytes is not None and nbytes >= max_bytes:
                break
            work = Work()
            with self._lock:
                if self._index.blocks.get(e.meta.key) is not e or e.data is None:
                    continue  # replaced or dropped since
                if e.disk_path is not None or e.spilling or not e.in_mem:
                    continue  # has a copy, is being written, or left memory
                if not self._index.reserve_disk(e.size, work, evict=evict):
                    if evict:
                        continue
                    break
                e.spilling = True
                work.spill.append((e, e.data))
            if self.finish(work):
                blocks += 1
                nbytes += e.size
        return blocks, nbytes

    def finish(self, work: Work) -> int:
        """Do a locked section's work; returns how many of its blocks were written."""
        # Write before deleting: a crash in between must leave the old copy of an
        # overwritten key, not nothing (the next start keeps the newest file per key).
        written = 0
        for e, data in work.spill:
            written += self._write(e, data)
        for path in work.trash:
            path.unlink(missing_ok=True)
        return written

    def _write(self, e: Entry, data: Buffer) -> bool:
        """Write a block whose room is reserved; True when its disk copy is indexed."""
        assert self._disk is not None
        try:
            path: Path | None = (
                self._disk.write(e.meta, data, packed=True)
                if e.packed
                else self._disk.write(e.meta, data)
            )
        except OSError as exc:
            log.error("disk write of %s failed: %s", e.meta.key, exc)
            path = None
        with self._lock:
            e.spilling = False
            current = self._index.blocks.get(e.meta.key) is e
            if path is not None and current:
                self._index.disk_add(e, path)
                if not e.in_mem:
                    e.data = None
                self._metrics.spills.inc()
                return True
            self._index.unreserve_disk(e.size)  # give the reservation back
            if current and not e.in_mem:
                if e.pinned and e.size <= self._index.memory_bytes:
                    self._index.mem_add(e)  # keep pinned KV in memory rather than lose it
                else:
                    self._index.unlink(e, Work())
        if path is not None:
            path.unlink(missing_ok=True)  # the block was replaced or dropped meanwhile
        return False

    def drop_corrupt(self, e: Entry, path: Path, exc: CorruptBlock) -> None:
        work = Work()
        with self._lock:
            if self._index.blocks.get(e.meta.key) is not e or e.disk_path != path:
                return  # evicted or replaced while we read: not corruption
            self._index.unlink(e, work)
        self.finish(work)
        self._metrics.corrupt.inc()
        log.warning("corrupt block %s dropped: %s", e.meta.key, exc)
