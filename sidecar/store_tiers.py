"""The store's index (`TierIndex`, owned by `sidecar.store.BlockStore`): which tier holds
each block and what it counts against the budgets (`footprint`, `link`, `unlink`, `mem_add`,
`mem_remove`, `disk_add`, `disk_remove`, `set_pinned`, `touch_mem`, `touch_disk`, `to_slot`,
`index_found`, `unreserve_disk`), and making room — `evict_memory`, `reserve_disk`,
`make_disk_room`, `fit_disk` and, under pin policy `lru`, which pinned session's blocks go
(`pinned_victim`, `drop_pinned`).
The index has no lock of its own: every method here is called with the store's lock held,
and its containers and counters are read under that lock and changed only through its
methods. The disk writes and deletes they decide are left in a `Work` for after the lock
(`sidecar.store_disk`). The policy they keep is `sidecar.store`'s docstring, and
docs/sidecar.md's "Tiers" and "Pin policy".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Literal

from sidecar.arena import ALIGN, Arena, round_up
from sidecar.blocks import BlockMeta, Buffer, Entry, Work
from sidecar.metrics import SidecarMetrics

log = logging.getLogger("sidecar.store")  # the store's records keep one logger name

PinPolicy = Literal["lru", "reserve"]


class TierIndex:
    """The index of both tiers, their budgets' counters and eviction (lock held by caller)."""

    def __init__(
        self,
        *,
        memory_bytes: int,
        disk_bytes: int,
        has_disk: bool,
        pin_policy: PinPolicy,
        arena: Arena | None,
        metrics: SidecarMetrics,
    ) -> None:
        self.memory_bytes = memory_bytes
        self.disk_bytes = disk_bytes
        self.has_disk = has_disk
        self.pin_policy: PinPolicy = pin_policy
        self.arena = arena
        self.metrics = metrics
        self.blocks: dict[str, Entry] = {}
        self.by_session: dict[str, set[str]] = {}
        # LRU order, oldest first; index by the entry's pinned flag
        self.mem_lru: tuple[OrderedDict[str, Entry], OrderedDict[str, Entry]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self.disk_lru: tuple[OrderedDict[str, Entry], OrderedDict[str, Entry]] = (
            OrderedDict(),
            OrderedDict(),
        )
        # blocks in memory that also have a disk copy, oldest first: under pin policy lru
        # these copies go before any pinned session's KV does
        self.copies: OrderedDict[str, Entry] = OrderedDict()
        self.mem_used = 0
        self.mem_region = 0  # of which in slots of the shared region
        self.disk_used = 0  # written + reserved for writes in flight
        self.pinned_used = 0

    # ---- the index (call with the lock held) ----------------------------------------
    def footprint(self, meta: BlockMeta, stored: int | None = None) -> int:
        """What a block counts against the budgets when not its length: the `stored` bytes
        of a packed block (`sidecar.coldkv`); with a shared region, whole 4 KiB slots (a
        100-byte block takes 4 KiB of the region)."""
        n = meta.length if stored is None else stored
        if self.arena is not None:
            return round_up(n, ALIGN)
        return 0 if stored is None else stored

    def link(self, e: Entry) -> None:
        self.blocks[e.meta.key] = e
        if e.session is not None:
            self.by_session.setdefault(e.session, set()).add(e.meta.key)
        if e.pinned:
            self.pinned_used += e.size

    def unlink(self, e: Entry, work: Work) -> None:
        """Forget a block everywhere (a spill in flight notices and deletes its file)."""
        del self.blocks[e.meta.key]
        if e.session is not None:
            keys = self.by_session[e.session]
            keys.discard(e.meta.key)
            if not keys:
                del self.by_session[e.session]
        if e.pinned:
            self.pinned_used -= e.size
        if e.in_mem:
            self.mem_remove(e)
        if e.disk_path is not None:
            self.disk_remove(e, work)
        e.data = None

    def mem_add(self, e: Entry) -> None:
        self.mem_lru[e.pinned][e.meta.key] = e
        e.in_mem = True
        self.mem_used += e.size
        if self.arena is not None and self.arena.holds(e.data):
            self.mem_region += e.size
        if e.disk_path is not None:
            self.copies[e.meta.key] = e

    def mem_remove(self, e: Entry) -> None:
        del self.mem_lru[e.pinned][e.meta.key]
        e.in_mem = False
        self.mem_used -= e.size
        if self.arena is not None and self.arena.holds(e.data):
            self.mem_region -= e.size
        self.copies.pop(e.meta.key, None)

    def disk_add(self, e: Entry, path: Path) -> None:
        """Count a written file (its space was reserved before the write)."""
        self.disk_lru[e.pinned][e.meta.key] = e
        e.disk_path = path
        if e.in_mem:
            self.copies[e.meta.key] = e

    def disk_remove(self, e: Entry, work: Work) -> None:
        del self.disk_lru[e.pinned][e.meta.key]
        self.copies.pop(e.meta.key, None)
        assert e.disk_path is not None
        work.trash.append(e.disk_path)
        e.disk_path = None
        self.disk_used -= e.size

    def set_pinned(self, e: Entry, pinned: bool) -> None:
        if e.pinned == pinned:
            return
        for tier in (self.mem_lru, self.disk_lru):
            if e.meta.key in tier[e.pinned]:
                tier[pinned][e.meta.key] = tier[e.pinned].pop(e.meta.key)
        self.pinned_used += e.size if pinned else -e.size
        e.pinned = pinned

    def touch_mem(self, e: Entry) -> None:
        """A block in memory was used: it is now the most recently used of its list."""
        self.mem_lru[e.pinned].move_to_end(e.meta.key)

    def touch_disk(self, e: Entry) -> None:
        self.disk_lru[e.pinned].move_to_end(e.meta.key)

    def to_slot(self, key: str, data: Buffer, slot: Buffer) -> None:
        """A block's heap payload `data` was copied into `slot` of the shared region: the
        block in memory keeps the slot (if it is still that block, with that payload)."""
        e = self.blocks.get(key)
        if e is not None and e.data is data and e.in_mem:
            e.data = slot
            self.mem_region += e.size

    def index_found(self, e: Entry, path: Path) -> None:
        """Index a block found on disk at start-up (its room counts as written)."""
        self.link(e)
        self.disk_used += e.size
        self.disk_add(e, path)

    def fit_disk(self, work: Work) -> None:
        """Drop unpinned disk blocks, oldest first, until the disk tier fits its budget."""
        while self.disk_used > self.disk_bytes and self.disk_lru[False]:
            self.unlink(next(iter(self.disk_lru[False].values())), work)

    def unreserve_disk(self, n: int) -> None:
        """Give back disk room reserved for a write that did not get indexed."""
        self.disk_used -= n

    # ---- making room (call with the lock held) --------------------------------------
    def reserve_disk(
        self, n: int, work: Work, protect: str | None = None, *, evict: bool = True
    ) -> bool:
        """Reserve n bytes on disk; with `evict`, make room first (`make_disk_room`),
        else only free room will do."""
        if not self.has_disk or n > self.disk_bytes:
            return False
        if evict:
            self.make_disk_room(n, work, protect)
        if self.disk_used + n > self.disk_bytes:
            return False
        self.disk_used += n
        return True

    def make_disk_room(self, n: int, work: Work, protect: str | None) -> None:
        """Make room for n bytes on disk by deleting unpinned LRU blocks (pin policy lru:
        then disk copies of blocks in memory, then the least recently used pinned sessions'
        blocks)."""
        unpinned = self.disk_lru[False]
        while self.disk_used + n > self.disk_bytes and unpinned:
            victim = next(iter(unpinned.values()))
            if victim.in_mem:
                self.disk_remove(victim, work)  # still in memory: only the copy goes
            else:
                self.unlink(victim, work)
                self.metrics.evictions.labels("disk").inc()
        while self.pin_policy == "lru" and self.disk_used + n > self.disk_bytes:
            # blocks in memory too give up their disk copy first: that costs a write when
            # they leave memory again, not a recompute (not a copy a reader still reads)
            copy = next((e for e in self.copies.values() if not e.readers), None)
            if copy is None:
                break
            self.disk_remove(copy, work)
        while self.disk_used + n > self.disk_bytes and self.pin_policy == "lru":
            victim = self.pinned_victim(self.disk_lru[True], protect)
            if victim is None:
                break
            if victim.in_mem:
                self.disk_remove(victim, work)  # still in memory: only the copy goes
            else:
                self.drop_pinned(victim, work, protect)

    def evict_memory(
        self, work: Work, protect: str | None = None, target: int | None = None
    ) -> None:
        """Make the memory tier fit `target` bytes (default: its budget)."""
        target = self.memory_bytes if target is None else target
        while self.mem_used > target:
            tier = self.mem_lru[False] or self.mem_lru[True]
            if not tier:
                return
            victim = next(iter(tier.values()))
            self.mem_remove(victim)
            if victim.disk_path is not None:
                victim.data = None  # the disk copy is current
            elif victim.spilling:
                pass  # its copy is being written (write-behind, flush): the write lets go of it
            elif victim.data is not None and self.reserve_disk(victim.size, work, protect):
                victim.spilling = True
                work.spill.append((victim, victim.data))
            elif not victim.pinned:
                self.unlink(victim, work)
                self.metrics.evictions.labels("memory").inc()
            elif self.pin_policy == "lru":
                # no room on disk (or no disk): the least recently used pinned session in
                # memory goes; the victim is that one unless it belongs to `protect`
                self.mem_add(victim)
                self.mem_lru[True].move_to_end(victim.meta.key, last=False)
                dropped = self.pinned_victim(self.mem_lru[True], protect)
                if dropped is None:
                    log.warning("memory over budget: every pinned block in it is in use")
                    return
                self.drop_pinned(dropped, work, protect)
            else:  # reserve: pinned, nowhere to go: keep it, over budget, rather than lose it
                self.mem_add(victim)
                log.warning(
                    "memory over budget: pinned block %s has no room on disk", victim.meta.key
                )
                return

    def pinned_victim(self, tier: OrderedDict[str, Entry], protect: str | None) -> Entry | None:
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

    def drop_pinned(self, victim: Entry, work: Work, protect: str | None) -> None:
        """Drop the victim's session's blocks (all that are not being read): its pin stays,
        so the KV its next turn recomputes is pinned again. The protected session (the one
        making room, when nothing else is left: its KV alone is more than the tiers hold)
        loses only the victim, its least recently used block, not the block being stored."""
        session = victim.session
        entries = [victim]
        if session is not None and session != protect:
            entries = [self.blocks[k] for k in self.by_session.get(session, ())]
        gone = 0
        for e in entries:
            if not _droppable(e):
                continue
            self.metrics.pinned_dropped.labels("memory" if e.in_mem else "disk").inc()
            self.unlink(e, work)
            gone += 1
        if gone:
            self.metrics.pinned_dropped_sessions.inc()
            log.info("pinned session %s: %d blocks dropped to make room", session, gone)


def _droppable(e: Entry) -> bool:
    """Not being read from disk, not being written to it, and in a tier (a block between
    tiers is being moved by the caller)."""
    return not e.readers and not e.spilling and (e.in_mem or e.disk_path is not None)
