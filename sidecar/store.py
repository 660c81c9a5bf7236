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
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Literal

from sidecar.arena import ALIGN, Arena, round_up
from sidecar.blocks import BlockMeta, Buffer, Entry, Work
from sidecar.disk import CorruptBlock, DiskTier
from sidecar.metrics import SidecarMetrics
from sidecar.sessions import PinTable, save_pins
from sidecar.wire import new_heap_buffer

log = logging.getLogger(__name__)

PinPolicy = Literal["lru", "reserve"]


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

    # ---- start-up -------------------------------------------------------------------
    def load_disk(self) -> int:
        """Index the blocks the disk tier holds from a previous run; returns how many."""
        if self.disk is None:
            return 0
        work = Work()
        with self._lock:
            for found in self.disk.scan():
                old = self._blocks.get(found.meta.key)
                if old is not None:  # an older copy of the same key: keep the newest
                    self._unlink(old, work)
                e = Entry(found.meta, found.meta.session, footprint=self._footprint(found.meta))
                e.pinned = self.pins.is_pinned(e.session)
                self._link(e)
                self.disk_used += e.size
                self._disk_add(e, found.path)
            while self.disk_used > self.disk_bytes and self._disk[False]:
                self._unlink(next(iter(self._disk[False].values())), work)
        self._finish(work)
        log.info("disk tier: %d blocks, %d bytes", len(self._blocks), self.disk_used)
        return len(self._blocks)

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

    def _footprint(self, meta: BlockMeta) -> int:
        """With a shared region every block in memory takes whole 4 KiB slots: that is what
        counts against the budgets (a 100-byte block takes 4 KiB of the region)."""
        return round_up(meta.length, ALIGN) if self.arena is not None else 0

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

    # ---- shared memory --------------------------------------------------------------
    def new_buffer(self, n: int) -> Buffer:
        """Where a block of `n` bytes about to be received should go: a slot of the shared
        region when there is one with room, else the heap."""
        if self.arena is not None:
            slot = self.alloc_slot(n)
            if slot is not None:
                return slot  # type: ignore[return-value]
        return new_heap_buffer(n)

    def alloc_slot(self, n: int) -> Any:
        """A slot of the shared region for a block of `n` bytes about to be stored. When the
        region has no room (slots of stores in flight, leases, fragments) while memory
        blocks live in it, the memory tier lets its least recently used blocks go, `n`
        bytes' worth at a time (spilled to disk as usual), until the slot fits. None
        (counted) when no block in memory holds any of the region."""
        assert self.arena is not None
        slot = self.arena.alloc(n)
        while slot is None and n <= self.arena.size and self.mem_region:
            work = Work()
            with self._lock:  # the least recently used blocks leave memory, n bytes' worth
                before = self.mem_used
                self._evict_memory(work, target=max(0, min(before, self.memory_bytes) - n))
                evicted = before - self.mem_used
            self._finish(work)  # spills written, evicted payloads let go
            slot = self.arena.alloc(n)
            if not evicted:
                break  # nothing left to evict: leases, sends or fragments hold the rest
        if slot is None:
            self.metrics.region_full.inc()
        return slot

    def lease(self, key: str) -> tuple[BlockMeta, Buffer] | bool | None:
        """A block's payload as a slot of the shared region, for an engine to copy from
        under a lease (the caller holds the returned slot until the lease ends). None on a
        miss; False when the block exists but no slot could be had for it (the engine
        reads it over TCP instead)."""
        assert self.arena is not None
        found = self.get(key)
        if found is None:
            return None
        meta, data = found
        if self.arena.holds(data):
            return meta, data
        slot = self.arena.alloc(len(data))  # (a read evicts nothing to make room)
        if slot is None:
            self.metrics.region_full.inc()
            return False
        slot[:] = memoryview(data).cast("B")
        with self._lock:  # later leases of this block need no copy
            e = self._blocks.get(key)
            if e is not None and e.data is data and e.in_mem:
                e.data = slot  # type: ignore[assignment]
                self.mem_region += e.size
        return meta, slot  # type: ignore[return-value]

    def lease_many(self, keys: list[str]) -> list[tuple[BlockMeta, Buffer, int] | bool | None]:
        """`lease` of each key, with the slot's offset in the region. Misses and blocks
        already in a slot (a load's usual keys) are found under one lock and counted once;
        the rest go through `lease`."""
        assert self.arena is not None
        found: list[tuple[BlockMeta, Buffer, int] | bool | None] = []
        rest, hits, misses = [], 0, 0
        with self._lock:
            for i, key in enumerate(keys):
                e = self._blocks.get(key)
                if e is None:
                    misses += 1
                    found.append(None)
                elif e.in_mem and (at := self.arena.place(e.data)) is not None:
                    self._mem[e.pinned].move_to_end(key)
                    hits += 1
                    found.append((e.meta, e.data, at))  # type: ignore[arg-type]
                else:
                    rest.append(i)
                    found.append(None)
        if misses:
            self.metrics.misses.inc(misses)
        if hits:
            self._memory_hits.inc(hits)
        for i in rest:
            got = self.lease(keys[i])
            if got:
                meta, slot = got  # type: ignore[misc]
                got = (meta, slot, self.arena.place(slot))  # type: ignore[assignment]
            found[i] = got  # type: ignore[assignment]
        return found

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

    def flush(self) -> int:
        """Write every memory-only block to the disk tier (clean shutdown), pinned ones
        first, most recently used first, making room as a spill does; returns how many."""
        with self._lock:
            pending = [*reversed(self._mem[True].values()), *reversed(self._mem[False].values())]
        return self._copy_to_disk(pending, evict=True)[0]

    def write_behind(self, max_bytes: int | None = None) -> int:
        """Give memory-only pinned blocks a disk copy, oldest first, so that a session's KV
        survives a crash of the process; they stay in memory. Only free disk room is used:
        nothing is evicted for a copy, and it stops at the first block that does not fit
        (or once `max_bytes` are written). Returns how many blocks it wrote."""
        with self._lock:
            pending = list(self._mem[True].values())
        blocks, nbytes = self._copy_to_disk(pending, evict=False, max_bytes=max_bytes)
        if blocks:
            self.metrics.write_behind_blocks.inc(blocks)
            self.metrics.write_behind_bytes.inc(nbytes)
            log.debug("write-behind: %d pinned blocks, %d bytes", blocks, nbytes)
        return blocks

    # ---- internals (call with the lock held) ----------------------------------------
    def _refuse(self, meta: BlockMeta, reason: str) -> bool:
        self.metrics.refused.labels(reason).inc()
        log.warning("refused block %s (%d bytes): %s", meta.key, meta.length, reason)
        return False

    def _link(self, e: Entry) -> None:
        self._blocks[e.meta.key] = e
        if e.session is not None:
            self._by_session.setdefault(e.session, set()).add(e.meta.key)
        if e.pinned:
            self.pinned_used += e.size

    def _unlink(self, e: Entry, work: Work) -> None:
        """Forget a block everywhere (a spill in flight notices and deletes its file)."""
        del self._blocks[e.meta.key]
        if e.session is not None:
            keys = self._by_session[e.session]
            keys.discard(e.meta.key)
            if not keys:
                del self._by_session[e.session]
        if e.pinned:
            self.pinned_used -= e.size
        if e.in_mem:
            self._mem_remove(e)
        if e.disk_path is not None:
            self._disk_remove(e, work)
        e.data = None

    def _mem_add(self, e: Entry) -> None:
        self._mem[e.pinned][e.meta.key] = e
        e.in_mem = True
        self.mem_used += e.size
        if self.arena is not None and self.arena.holds(e.data):
            self.mem_region += e.size
        if e.disk_path is not None:
            self._copies[e.meta.key] = e

    def _mem_remove(self, e: Entry) -> None:
        del self._mem[e.pinned][e.meta.key]
        e.in_mem = False
        self.mem_used -= e.size
        if self.arena is not None and self.arena.holds(e.data):
            self.mem_region -= e.size
        self._copies.pop(e.meta.key, None)

    def _disk_add(self, e: Entry, path: Path) -> None:
        """Count a written file (its space was reserved before the write)."""
        self._disk[e.pinned][e.meta.key] = e
        e.disk_path = path
        if e.in_mem:
            self._copies[e.meta.key] = e

    def _disk_remove(self, e: Entry, work: Work) -> None:
        del self._disk[e.pinned][e.meta.key]
        self._copies.pop(e.meta.key, None)
        assert e.disk_path is not None
        work.trash.append(e.disk_path)
        e.disk_path = None
        self.disk_used -= e.size

    def _set_pinned(self, e: Entry, pinned: bool) -> None:
        if e.pinned == pinned:
            return
        for tier in (self._mem, self._disk):
            if e.meta.key in tier[e.pinned]:
                tier[pinned][e.meta.key] = tier[e.pinned].pop(e.meta.key)
        self.pinned_used += e.size if pinned else -e.size
        e.pinned = pinned

    def _drop_session(self, session: str, work: Work) -> tuple[int, int]:
        self.pins.remove(session)
        entries = [self._blocks[k] for k in self._by_session.get(session, ())]
        for e in entries:
            self._unlink(e, work)
        return len(entries), sum(e.size for e in entries)

    def _reserve_disk(
        self, n: int, work: Work, protect: str | None = None, *, evict: bool = True
    ) -> bool:
        """Reserve n bytes on disk; with `evict`, make room first (`_make_disk_room`),
        else only free room will do."""
        if self.disk is None or n > self.disk_bytes:
            return False
        if evict:
            self._make_disk_room(n, work, protect)
        if self.disk_used + n > self.disk_bytes:
            return False
        self.disk_used += n
        return True

    def _make_disk_room(self, n: int, work: Work, protect: str | None) -> None:
        """Make room for n bytes on disk by deleting unpinned LRU blocks (pin policy lru:
        then disk copies of blocks in memory, then the least recently used pinned sessions'
        blocks)."""
        unpinned = self._disk[False]
        while self.disk_used + n > self.disk_bytes and unpinned:
            victim = next(iter(unpinned.values()))
            if victim.in_mem:
                self._disk_remove(victim, work)  # still in memory: only the copy goes
            else:
                self._unlink(victim, work)
                self.metrics.evictions.labels("disk").inc()
        while self.pin_policy == "lru" and self.disk_used + n > self.disk_bytes:
            # blocks in memory too give up their disk copy first: that costs a write when
            # they leave memory again, not a recompute (not a copy a reader still reads)
            copy = next((e for e in self._copies.values() if not e.readers), None)
            if copy is None:
                break
            self._disk_remove(copy, work)
        while self.disk_used + n > self.disk_bytes and self.pin_policy == "lru":
            victim = self._pinned_victim(self._disk[True], protect)
            if victim is None:
                break
            if victim.in_mem:
                self._disk_remove(victim, work)  # still in memory: only the copy goes
            else:
                self._drop_pinned(victim, work, protect)

    def _evict_memory(
        self, work: Work, protect: str | None = None, target: int | None = None
    ) -> None:
        """Make the memory tier fit `target` bytes (default: its budget)."""
        target = self.memory_bytes if target is None else target
        while self.mem_used > target:
            tier = self._mem[False] or self._mem[True]
            if not tier:
                return
            victim = next(iter(tier.values()))
            self._mem_remove(victim)
            if victim.disk_path is not None:
                victim.data = None  # the disk copy is current
            elif victim.spilling:
                pass  # its copy is being written (write-behind, flush): the write lets go of it
            elif victim.data is not None and self._reserve_disk(victim.size, work, protect):
                victim.spilling = True
                work.spill.append((victim, victim.data))
            elif not victim.pinned:
                self._unlink(victim, work)
                self.metrics.evictions.labels("memory").inc()
            elif self.pin_policy == "lru":
                # no room on disk (or no disk): the least recently used pinned session in
                # memory goes; the victim is that one unless it belongs to `protect`
                self._mem_add(victim)
                self._mem[True].move_to_end(victim.meta.key, last=False)
                dropped = self._pinned_victim(self._mem[True], protect)
                if dropped is None:
                    log.warning("memory over budget: every pinned block in it is in use")
                    return
                self._drop_pinned(dropped, work, protect)
            else:  # reserve: pinned, nowhere to go: keep it, over budget, rather than lose it
                self._mem_add(victim)
                log.warning(
                    "memory over budget: pinned block %s has no room on disk", victim.meta.key
                )
                return

    def _pinned_victim(self, tier: OrderedDict[str, Entry], protect: str | None) -> Entry | None:
        """The least recently used pinned block of the tier that may be dropped: not being
        read, not the protected session's (unless nothing else is left)."""
        fallback = None
        for e in tier.values():  # oldest first
            if not _droppable(e):
                continue
            if e.session != protect:
                return e
            fallback = fallback or e
        return fallback

    def _drop_pinned(self, victim: Entry, work: Work, protect: str | None) -> None:
        """Drop the victim's session's blocks (all that are not being read): its pin stays,
        so the KV its next turn recomputes is pinned again. The protected session (the one
        making room, when nothing else is left: its KV alone is more than the tiers hold)
        loses only the victim, its least recently used block, not the block being stored."""
        session = victim.session
        entries = [victim]
        if session is not None and session != protect:
            entries = [self._blocks[k] for k in self._by_session.get(session, ())]
        gone = 0
        for e in entries:
            if not _droppable(e):
                continue
            self.metrics.pinned_dropped.labels("memory" if e.in_mem else "disk").inc()
            self._unlink(e, work)
            gone += 1
        if gone:
            self.metrics.pinned_dropped_sessions.inc()
            log.info("pinned session %s: %d blocks dropped to make room", session, gone)

    # ---- work done outside the lock -------------------------------------------------
    def _copy_to_disk(
        self, pending: list[Entry], *, evict: bool, max_bytes: int | None = None
    ) -> tuple[int, int]:
        """Write the blocks of `pending` that are still memory-only to the disk tier, one
        at a time, keeping them in memory; returns (blocks, bytes) written. With `evict`,
        room is made as for a spill and a block that finds none is skipped; without, only
        free room is used and the first block that finds none ends it."""
        if self.disk is None:
            return 0, 0
        blocks = nbytes = 0
        for e in pending:
            if max_bytes is not None and nbytes >= max_bytes:
                break
            work = Work()
            with self._lock:
                if self._blocks.get(e.meta.key) is not e or e.data is None:
                    continue  # replaced or dropped since
                if e.disk_path is not None or e.spilling or not e.in_mem:
                    continue  # has a copy, is being written, or left memory
                if not self._reserve_disk(e.size, work, evict=evict):
                    if evict:
                        continue
                    break
                e.spilling = True
                work.spill.append((e, e.data))
            if self._finish(work):
                blocks += 1
                nbytes += e.size
        return blocks, nbytes

    def _finish(self, work: Work) -> int:
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
        assert self.disk is not None
        try:
            path: Path | None = self.disk.write(e.meta, data)
        except OSError as exc:
            log.error("disk write of %s failed: %s", e.meta.key, exc)
            path = None
        with self._lock:
            e.spilling = False
            current = self._blocks.get(e.meta.key) is e
            if path is not None and current:
                self._disk_add(e, path)
                if not e.in_mem:
                    e.data = None
                self.metrics.spills.inc()
                return True
            self.disk_used -= e.size  # give the reservation back
            if current and not e.in_mem:
                if e.pinned and e.size <= self.memory_bytes:
                    self._mem_add(e)  # keep pinned KV in memory rather than lose it
                else:
                    self._unlink(e, Work())
        if path is not None:
            path.unlink(missing_ok=True)  # the block was replaced or dropped meanwhile
        return False

    def _drop_corrupt(self, e: Entry, path: Path, exc: CorruptBlock) -> None:
        work = Work()
        with self._lock:
            if self._blocks.get(e.meta.key) is not e or e.disk_path != path:
                return  # evicted or replaced while we read: not corruption
            self._unlink(e, work)
        self._finish(work)
        self.metrics.corrupt.inc()
        log.warning("corrupt block %s dropped: %s", e.meta.key, exc)


def _droppable(e: Entry) -> bool:
    """Not being read from disk, not being written to it, and in a tier (a block between
    tiers is being moved by the caller)."""
    return not e.readers and not e.spilling and (e.in_mem or e.disk_path is not None)
