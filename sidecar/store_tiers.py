"""The store's index under its lock (`TierOps`, a base of `sidecar.store.BlockStore`: the
state below is the store's): which tier holds each block and what it counts against the
budgets (`_link`, `_unlink`, `_mem_add`, `_mem_remove`, `_disk_add`, `_disk_remove`,
`_set_pinned`), and making room — `_evict_memory`, `_reserve_disk`, `_make_disk_room` and,
under pin policy `lru`, which pinned session's blocks go (`_pinned_victim`, `_drop_pinned`).
Every method here is called with the lock held; the disk writes and deletes they decide are
left in a `Work` for after it (`sidecar.store_disk`). The policy they keep is
`sidecar.store`'s docstring, and docs/sidecar.md's "Tiers" and "Pin policy".
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Literal

from prometheus_client import Counter

from sidecar.arena import ALIGN, Arena, round_up
from sidecar.blocks import BlockMeta, Entry, Work
from sidecar.disk import DiskTier
from sidecar.metrics import SidecarMetrics
from sidecar.sessions import PinTable

log = logging.getLogger("sidecar.store")  # the store's records keep one logger name

PinPolicy = Literal["lru", "reserve"]


class TierOps:
    """The index's bookkeeping and eviction (a base of `BlockStore`: its state)."""

    memory_bytes: int
    arena: Arena | None
    pin_policy: PinPolicy
    disk: DiskTier | None
    disk_bytes: int
    pin_budget: int
    pins: PinTable
    metrics: SidecarMetrics
    _lock: threading.Lock
    _blocks: dict[str, Entry]
    _by_session: dict[str, set[str]]
    _mem: tuple[OrderedDict[str, Entry], OrderedDict[str, Entry]]
    _disk: tuple[OrderedDict[str, Entry], OrderedDict[str, Entry]]
    _copies: OrderedDict[str, Entry]
    _memory_hits: Counter
    mem_used: int
    mem_region: int
    disk_used: int
    pinned_used: int

    # ---- the index (call with the lock held) ----------------------------------------
    def _footprint(self, meta: BlockMeta) -> int:
        """With a shared region every block in memory takes whole 4 KiB slots: that is what
        counts against the budgets (a 100-byte block takes 4 KiB of the region)."""
        return round_up(meta.length, ALIGN) if self.arena is not None else 0

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

    # ---- making room (call with the lock held) --------------------------------------
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


def _droppable(e: Entry) -> bool:
    """Not being read from disk, not being written to it, and in a tier (a block between
    tiers is being moved by the caller)."""
    return not e.readers and not e.spilling and (e.in_mem or e.disk_path is not None)
