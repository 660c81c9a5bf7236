"""The block store: a memory tier and a disk tier under one index, with session pins.

Policy (docs/sidecar.md has the long form):
- A PUT lands in memory. When memory is over budget the least recently used block
  leaves it — unpinned blocks first, then pinned ones — and spills to the disk tier
  (if it has no copy there yet). A block larger than the memory budget goes straight
  to disk.
- The disk tier makes room by deleting its least recently used *unpinned* blocks first.
  A block that finds no room is dropped if unpinned; a pinned one: see the pin policy.
- Pinned blocks (their session is pinned and not expired) are dropped to make room only
  when no unpinned block is left, and how depends on the pin policy:
  - `lru` (default): pins are a priority, not a reservation. Memory holds the most recently
    used blocks; the least recently used pinned ones spill to disk; when the disk tier is
    full (or there is none), the pinned session whose block is least recently used loses
    its blocks (all of them: a session's KV is a prefix chain, a part of it is worth little),
    counted in `pinned_dropped_*`; its pin stays, so the blocks its next turn recomputes
    are pinned again. The session the current PUT writes goes last, and a block being read
    from disk right now is never dropped (a memory read holds its own reference to the
    payload, so dropping that block does not disturb it).
  - `reserve` (the first policy, kept for comparison): a new pinned block that would take
    pinned bytes past the pin budget (memory + disk budgets) is refused, and pinned blocks
    are never dropped: a pinned block with no room on disk stays in memory, over budget.
- A GET served from disk promotes the block back into memory (keeping the disk copy).
- Write-behind (`write_behind`, run every few seconds by the service): pinned blocks that
  live only in memory get a disk copy too, oldest first, in free disk room only (nothing is
  evicted for it), so a session's KV survives a crash of the process.

One lock guards the index; payload bytes move outside it (socket I/O, disk writes and
reads), so concurrent connections only serialize on dictionary updates.

With a shared-memory region (`sidecar.arena`, when an engine runs on this node) the memory
tier's payloads are slots of that region: a PUT is received straight into one, and
`lease` hands an engine a block's place in it (docs/sidecar.md, "Local data path"). A
block that could not get a slot (the region fragmented, or held by leases) stays in the
heap and is copied into the region when an engine leases it.

The store is `BlockStore` here (its state, PUT/GET, sessions and pins, stats) and three
bases, one per seam: `sidecar.store_tiers` (`TierOps`: the index's bookkeeping and
eviction, the policy above, under the lock), `sidecar.store_disk` (`DiskOps`: disk writes,
deletes and reads outside the lock, start-up, flush, write-behind) and
`sidecar.store_region` (`RegionOps`: slots of the shared region and leases).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from sidecar.arena import Arena
from sidecar.blocks import BlockMeta, Buffer, Entry, Work
from sidecar.disk import CorruptBlock, DiskTier
from sidecar.metrics import SidecarMetrics
from sidecar.sessions import PinTable, save_pins
from sidecar.store_region import RegionOps
from sidecar.store_tiers import PinPolicy

log = logging.getLogger(__name__)


class BlockStore(RegionOps):
    def __init__(
        self,
        *,
        memory_bytes: int,
        disk: DiskTier | None = None,
        disk_bytes: int = 0,
        pin_policy: PinPolicy = "lru",
        pins: PinTable | None = None,
        metrics: SidecarMetrics | None = None,
        arena: Arena | None = None,
    ) -> None:
        self.memory_bytes = memory_bytes
        self.arena = arena
        self.pin_policy = pin_policy
        self.disk = disk if disk_bytes > 0 else None
        self.disk_bytes = disk_bytes if self.disk else 0
        self.pin_budget = self.memory_bytes + self.disk_bytes
        self.pins = pins if pins is not None else PinTable()
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._lock = threading.Lock()
        self._blocks: dict[str, Entry] = {}
        self._by_session: dict[str, set[str]] = {}
        # LRU order, oldest first; index by the entry's pinned flag
        self._mem: tuple[OrderedDict[str, Entry], OrderedDict[str, Entry]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self._disk: tuple[OrderedDict[str, Entry], OrderedDict[str, Entry]] = (
            OrderedDict(),
            OrderedDict(),
        )
        # blocks in memory that also have a disk copy, oldest first: under pin policy lru
        # these copies go before any pinned session's KV does
        self._copies: OrderedDict[str, Entry] = OrderedDict()
        self._memory_hits = self.metrics.hits.labels("memory")
        self.mem_used = 0
        self.mem_region = 0  # of which in slots of the shared region
        self.disk_used = 0  # written + reserved for writes in flight
        self.pinned_used = 0

    # ---- data path ------------------------------------------------------------------
    def put(self, meta: BlockMeta, data: Buffer) -> bool:
        """Store a block; False when it is refused (see the module docstring)."""
        work = Work()
        with self._lock:
            e = Entry(meta, meta.session, footprint=self._footprint(meta))
            e.pinned = self.pins.is_pinned(e.session)
            old = self._blocks.get(meta.key)
            old_pinned = old.size if old is not None and old.pinned else 0
            if (
                self.pin_policy == "reserve"
                and e.pinned
                and self.pinned_used - old_pinned + e.size > self.pin_budget
            ):
                return self._refuse(meta, "pin_budget")
            to_disk = e.size > self.memory_bytes
            if to_disk and (e.size > self.disk_bytes or self.disk is None):
                return self._refuse(meta, "too_large")
            if old is not None:
                self._unlink(old, work)
            stored = not to_disk or self._reserve_disk(e.size, work, protect=e.session)
            if stored:
                e.data = data
                self._link(e)
                if to_disk:
                    e.spilling = True
                    work.spill.append((e, data))
                else:
                    self._mem_add(e)
                    self._evict_memory(work, protect=e.session)
        self._finish(work)
        return stored or self._refuse(meta, "disk_full")

    def get(self, key: str) -> tuple[BlockMeta, Buffer] | None:
        with self._lock:
            e = self._blocks.get(key)
            if e is None:
                self.metrics.misses.inc()
                return None
            if e.data is not None:
                if e.in_mem:
                    self._mem[e.pinned].move_to_end(key)
                self._memory_hits.inc()
                return e.meta, e.data
            path = e.disk_path
            assert path is not None and self.disk is not None
            self._disk[e.pinned].move_to_end(key)
            e.readers += 1  # not dropped while we read it
        try:
            data = self.disk.read(e.meta, path)
        except CorruptBlock as exc:
            with self._lock:
                e.readers -= 1
            self._drop_corrupt(e, path, exc)
            self.metrics.misses.inc()
            return None
        self.metrics.hits.labels("disk").inc()
        work = Work()
        with self._lock:  # promote: the block is hot again
            e.readers -= 1
            if self._blocks.get(key) is e and not e.in_mem and e.size <= self.memory_bytes:
                e.data = data
                self._mem_add(e)
                self._evict_memory(work, protect=e.session)
        self._finish(work)
        return e.meta, data

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._blocks

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    # ---- sessions -------------------------------------------------------------------
    def pin(self, session: str, expires_at: float) -> None:
        """Pin or extend a session; its blocks already stored become pinned too."""
        if expires_at <= time.time():
            self.drop_session(session)
            return
        with self._lock:
            self.pins.set(session, expires_at)
            for key in self._by_session.get(session, ()):
                self._set_pinned(self._blocks[key], True)

    def drop_session(self, session: str) -> tuple[int, int]:
        """Drop a session's blocks from every tier and its pin; returns (blocks, bytes)."""
        work = Work()
        with self._lock:
            dropped = self._drop_session(session, work)
        self._finish(work)
        return dropped

    def reap(self, now: float | None = None) -> int:
        """Drop the blocks of sessions whose pin expired; save the pins if they changed."""
        work = Work()
        now = time.time() if now is None else now
        with self._lock:
            expired = self.pins.expired(now)
            for session in expired:
                self._drop_session(session, work)
            snapshot = self.pins.snapshot() if self.pins.dirty and self.pins.path else None
        self._finish(work)
        if expired:
            self.metrics.expired.inc(len(expired))
            log.info("dropped %d expired sessions", len(expired))
        if snapshot is not None and self.pins.path is not None:
            save_pins(self.pins.path, snapshot)
        return len(expired)

    def session_info(self, session: str) -> dict[str, Any]:
        with self._lock:
            keys = self._by_session.get(session, ())
            return {
                "session": session,
                "blocks": len(keys),
                "bytes": sum(self._blocks[k].size for k in keys),
                "tokens": sum(self._blocks[k].meta.tokens for k in keys),
                "pinned": self.pins.is_pinned(session),
                "expires_at": self.pins.expires_at(session),
            }

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "blocks": len(self._blocks),
                "memory_blocks": len(self._mem[0]) + len(self._mem[1]),
                "memory_bytes_used": self.mem_used,
                "memory_bytes_budget": self.memory_bytes,
                "disk_blocks": len(self._disk[0]) + len(self._disk[1]),
                "disk_bytes_used": self.disk_used,
                "disk_bytes_budget": self.disk_bytes,
                "pinned_bytes": self.pinned_used,
                "pinned_sessions": len(self.pins),
                "sessions": len(self._by_session),
                "pin_policy": self.pin_policy,
                **(
                    {"region_bytes": self.arena.size, "region_used_bytes": self.arena.used}
                    if self.arena is not None
                    else {}
                ),
            }

    # ---- internals (call with the lock held) ----------------------------------------
    def _refuse(self, meta: BlockMeta, reason: str) -> bool:
        self.metrics.refused.labels(reason).inc()
        log.warning("refused block %s (%d bytes): %s", meta.key, meta.length, reason)
        return False

    def _drop_session(self, session: str, work: Work) -> tuple[int, int]:
        self.pins.remove(session)
        entries = [self._blocks[k] for k in self._by_session.get(session, ())]
        for e in entries:
            self._unlink(e, work)
        return len(entries), sum(e.size for e in entries)
