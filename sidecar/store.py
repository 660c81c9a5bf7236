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

With `cold_kv="fp8"` (`CTX_SIDECAR_COLD_KV`) a block of bf16/fp16/fp32 KV is kept packed
(`sidecar.coldkv`) in both tiers and counts its packed bytes; a GET or lease unpacks it, and
one that does not unpack is dropped and a miss (docs/sidecar.md, "Compressed tiers").

One lock guards the index; payload bytes move outside it (socket I/O, disk writes and
reads), so concurrent connections only serialize on dictionary updates.

With a shared-memory region (`sidecar.arena`, when an engine runs on this node) the memory
tier's payloads are slots of that region: a PUT is received straight into one, and
`lease` hands an engine a block's place in it (docs/sidecar.md, "Local data path"). A
block that could not get a slot (the region fragmented, or held by leases) stays in the
heap and is copied into the region when an engine leases it.

The store is `BlockStore` here (the lock, PUT/GET, sessions and pins, stats), composed of
one object per piece of state, each built here and given what it needs:
`sidecar.store_tiers.TierIndex` (the index of both tiers and its budgets' counters, its
bookkeeping and eviction: the policy above, under the store's lock),
`sidecar.store_disk.DiskWriter` (disk writes, deletes and reads outside the lock, start-up,
flush, write-behind) and `sidecar.store_region.RegionSlots` (slots of the shared region and
leases). Every method of theirs that says "call with the lock held" runs under the one lock
`BlockStore` creates and hands them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sidecar import coldkv
from sidecar.arena import Arena
from sidecar.blocks import BlockMeta, Buffer, Entry, Work
from sidecar.disk import CorruptBlock, DiskTier
from sidecar.metrics import SidecarMetrics
from sidecar.sessions import PinTable, save_pins
from sidecar.states import StateBlocks
from sidecar.store_disk import DiskWriter
from sidecar.store_region import RegionSlots
from sidecar.store_tiers import PinPolicy, TierIndex

log = logging.getLogger(__name__)


class BlockStore:
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
        cold_kv: coldkv.ColdKV = "off",
        state_blocks: int = 0,
    ) -> None:
        self.arena = arena
        self._states = StateBlocks(state_blocks)  # a session's newest state blocks kept
        self.cold_kv: coldkv.ColdKV = cold_kv
        self.disk = disk if disk_bytes > 0 else None
        disk_bytes = disk_bytes if self.disk else 0
        self.pin_budget = memory_bytes + disk_bytes
        self.pins = pins if pins is not None else PinTable()
        self.metrics = metrics if metrics is not None else SidecarMetrics()
        self._lock = threading.Lock()
        self._index = TierIndex(
            memory_bytes=memory_bytes,
            disk_bytes=disk_bytes,
            has_disk=self.disk is not None,
            pin_policy=pin_policy,
            arena=arena,
            metrics=self.metrics,
        )
        self._writer = DiskWriter(
            index=self._index, lock=self._lock, disk=self.disk, pins=self.pins, metrics=self.metrics
        )
        self._region = RegionSlots(
            index=self._index,
            lock=self._lock,
            writer=self._writer,
            arena=arena,
            metrics=self.metrics,
            get=self.get,
        )
        self._memory_hits = self.metrics.hits.labels("memory")

    # ---- budgets and what counts against them (the index's) ---------------------------
    @property
    def memory_bytes(self) -> int:
        return self._index.memory_bytes

    @property
    def disk_bytes(self) -> int:
        return self._index.disk_bytes

    @property
    def pin_policy(self) -> PinPolicy:
        return self._index.pin_policy

    @pin_policy.setter
    def pin_policy(self, policy: PinPolicy) -> None:
        self._index.pin_policy = policy

    @property
    def mem_used(self) -> int:
        return self._index.mem_used

    @property
    def mem_region(self) -> int:
        """Of `mem_used`, the bytes in slots of the shared region."""
        return self._index.mem_region

    @property
    def disk_used(self) -> int:
        """Written + reserved for writes in flight."""
        return self._index.disk_used

    @property
    def pinned_used(self) -> int:
        return self._index.pinned_used

    # ---- data path ------------------------------------------------------------------
    def put(self, meta: BlockMeta, data: Buffer) -> bool:
        """Store a block; False when it is refused (see the module docstring). With
        `cold_kv` the block is kept packed where `sidecar.coldkv` packs it."""
        work = Work()
        index = self._index
        packed = self._pack(meta, data) if self.cold_kv != "off" else None
        if packed is not None:
            data = packed
        with self._lock:
            packed_len = None if packed is None else len(packed)
            e = Entry(meta, meta.session, footprint=index.footprint(meta, packed_len))
            e.packed = packed is not None
            e.pinned = self.pins.is_pinned(e.session)
            old = index.blocks.get(meta.key)
            old_pinned = old.size if old is not None and old.pinned else 0
            if (
                index.pin_policy == "reserve"
                and e.pinned
                and index.pinned_used - old_pinned + e.size > self.pin_budget
            ):
                return self._refuse(meta, "pin_budget")
            to_disk = e.size > index.memory_bytes
            if to_disk and (e.size > index.disk_bytes or self.disk is None):
                return self._refuse(meta, "too_large")
            if old is not None:
                index.unlink(old, work)
            stored = not to_disk or index.reserve_disk(e.size, work, protect=e.session)
            if stored:
                e.data = data
                index.link(e)
                for key in self._states.added(meta):  # a session's older state blocks
                    if (stale := index.blocks.get(key)) is not None:
                        index.unlink(stale, work)
                if to_disk:
                    e.spilling = True
                    work.spill.append((e, data))
                else:
                    index.mem_add(e)
                    index.evict_memory(work, protect=e.session)
        self._writer.finish(work)
        return stored or self._refuse(meta, "disk_full")

    def get(
        self, key: str, into: Callable[[int], Buffer | None] | None = None
    ) -> tuple[BlockMeta, Buffer] | None:
        """A block's meta and payload, or None on a miss. A packed block is unpacked into
        `into(length)` where that gives a buffer (a lease: a slot of the region)."""
        index = self._index
        with self._lock:
            e = index.blocks.get(key)
            if e is None:
                self.metrics.misses.inc()
                return None
            if e.data is not None:
                if e.in_mem:
                    index.touch_mem(e)
                if not e.packed:
                    self._memory_hits.inc()
                    return e.meta, e.data
                data, path = e.data, None
            else:
                path = e.disk_path
                assert path is not None and self.disk is not None
                index.touch_disk(e)
                e.readers += 1  # not dropped while we read it
        if path is None:  # a packed block in memory
            return self._unpacked(e, data, "memory", into)
        assert self.disk is not None
        try:
            if e.packed:
                data = self.disk.read(e.meta, path, packed=True)
            else:
                data = self.disk.read(e.meta, path)
        except CorruptBlock as exc:
            with self._lock:
                e.readers -= 1
            self._writer.drop_corrupt(e, path, exc)
            self.metrics.misses.inc()
            return None
        work = Work()
        with self._lock:  # promote: the block is hot again
            e.readers -= 1
            if index.blocks.get(key) is e and not e.in_mem and e.size <= index.memory_bytes:
                e.data = data
                index.mem_add(e)
                index.evict_memory(work, protect=e.session)
        self._writer.finish(work)
        if e.packed:
            return self._unpacked(e, data, "disk", into)
        self.metrics.hits.labels("disk").inc()
        return e.meta, data

    def exists(self, key: str) -> bool:
        with self._lock:
            return key in self._index.blocks

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index.blocks)

    # ---- shared memory (the region's) -----------------------------------------------
    def new_buffer(self, n: int) -> Buffer:
        """`RegionSlots.new_buffer`: a slot of the shared region for a block of `n` bytes
        about to be received, else the heap."""
        return self._region.new_buffer(n)

    def alloc_slot(self, n: int) -> Any:
        """`RegionSlots.alloc_slot`: a slot of the region, memory letting blocks go for it."""
        return self._region.alloc_slot(n)

    def lease(self, key: str) -> tuple[BlockMeta, Buffer] | bool | None:
        """`RegionSlots.lease`: a block's payload as a slot of the region (None: a miss;
        False: no slot could be had)."""
        return self._region.lease(key)

    def lease_many(self, keys: list[str]) -> list[tuple[BlockMeta, Buffer, int] | bool | None]:
        """`RegionSlots.lease_many`: `lease` of each key, with the slot's offset."""
        return self._region.lease_many(keys)

    # ---- the disk tier (the disk writer's) ------------------------------------------
    def load_disk(self) -> int:
        """`DiskWriter.load_disk`: index the blocks the disk tier holds from a previous
        run; returns how many."""
        return self._writer.load_disk()

    def flush(self) -> int:
        """`DiskWriter.flush`: write every memory-only block to disk (clean shutdown)."""
        return self._writer.flush()

    def write_behind(self, max_bytes: int | None = None) -> int:
        """`DiskWriter.write_behind`: give memory-only pinned blocks a disk copy in free
        disk room; returns how many blocks it wrote."""
        return self._writer.write_behind(max_bytes)

    # ---- sessions -------------------------------------------------------------------
    def pin(self, session: str, expires_at: float) -> None:
        """Pin or extend a session; its blocks already stored become pinned too."""
        if expires_at <= time.time():
            self.drop_session(session)
            return
        with self._lock:
            self.pins.set(session, expires_at)
            index = self._index
            for key in index.by_session.get(session, ()):
                index.set_pinned(index.blocks[key], True)

    def drop_session(self, session: str) -> tuple[int, int]:
        """Drop a session's blocks from every tier and its pin; returns (blocks, bytes)."""
        work = Work()
        with self._lock:
            dropped = self._drop_session(session, work)
        self._writer.finish(work)
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
        self._writer.finish(work)
        if expired:
            self.metrics.expired.inc(len(expired))
            log.info("dropped %d expired sessions", len(expired))
        if snapshot is not None and self.pins.path is not None:
            save_pins(self.pins.path, snapshot)
        return len(expired)

    def session_info(self, session: str) -> dict[str, Any]:
        with self._lock:
            blocks = self._index.blocks
            keys = self._index.by_session.get(session, ())
            return {
                "session": session,
                "blocks": len(keys),
                "bytes": sum(blocks[k].size for k in keys),
                "tokens": sum(blocks[k].meta.tokens for k in keys),
                "pinned": self.pins.is_pinned(session),
                "expires_at": self.pins.expires_at(session),
            }

    def stats(self) -> dict[str, Any]:
        index = self._index
        with self._lock:
            return {
                "blocks": len(index.blocks),
                "memory_blocks": len(index.mem_lru[0]) + len(index.mem_lru[1]),
                "memory_bytes_used": index.mem_used,
                "memory_bytes_budget": index.memory_bytes,
                "disk_blocks": len(index.disk_lru[0]) + len(index.disk_lru[1]),
                "disk_bytes_used": index.disk_used,
                "disk_bytes_budget": index.disk_bytes,
                "pinned_bytes": index.pinned_used,
                "pinned_sessions": len(self.pins),
                "sessions": len(index.by_session),
                "pin_policy": index.pin_policy,
                "cold_kv": self.cold_kv,
                **(
                    {"region_bytes": self.arena.size, "region_used_bytes": self.arena.used}
                    if self.arena is not None
                    else {}
                ),
            }

    # ---- packed blocks (sidecar.coldkv; outside the lock) ----------------------------
    def _pack(self, meta: BlockMeta, data: Buffer) -> Buffer | None:
        """A block's packed form, where it packs: in a free slot of the shared region (no
        block is evicted for it) when there is one, else the heap."""
        packed = coldkv.pack(meta, data)
        if packed is None or self.arena is None:
            return packed
        slot = self.arena.alloc(len(packed))
        if slot is None:
            return packed
        slot[:] = memoryview(packed)
        return slot  # type: ignore[no-any-return]

    def _unpacked(
        self, e: Entry, data: Buffer, tier: str, into: Callable[[int], Buffer | None] | None
    ) -> tuple[BlockMeta, Buffer] | None:
        """A packed block's payload in its own dtype; a payload that does not unpack is
        dropped and is a miss (counted as corrupt), never KV."""
        try:
            raw = coldkv.unpack(e.meta, data, into(e.meta.length) if into else None)
        except coldkv.BadPacked as exc:
            work = Work()
            with self._lock:
                if self._index.blocks.get(e.meta.key) is e:
                    self._index.unlink(e, work)
            self._writer.finish(work)
            self.metrics.corrupt.inc()
            self.metrics.misses.inc()
            log.warning("packed block %s dropped: %s", e.meta.key, exc)
            return None
        self.metrics.hits.labels(tier).inc()
        return e.meta, raw

    # ---- internals (call with the lock held) ----------------------------------------
    def _refuse(self, meta: BlockMeta, reason: str) -> bool:
        self.metrics.refused.labels(reason).inc()
        log.warning("refused block %s (%d bytes): %s", meta.key, meta.length, reason)
        return False

    def _drop_session(self, session: str, work: Work) -> tuple[int, int]:
        self.pins.remove(session)
        self._states.forget(session)
        index = self._index
        entries = [index.blocks[k] for k in index.by_session.get(session, ())]
        for e in entries:
            index.unlink(e, work)
        return len(entries), sum(e.size for e in entries)
