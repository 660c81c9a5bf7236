"""The store's side of the shared region (`RegionSlots`, owned by
`sidecar.store.BlockStore` and given its index, lock, disk writer, arena, metrics and its
`get`), used when an engine runs on this node (docs/sidecar.md, "Local data path"): where a
block about to be received goes (`new_buffer`, `alloc_slot`: a slot of the region, the
memory tier letting blocks go to make one), and a block's place in the region for an
engine's lease (`lease`, `lease_many`: a block still in the heap is copied into a slot on
its first lease; a packed block, `sidecar.coldkv`, is unpacked into a slot of its
lease's own at every lease).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sidecar.arena import Arena
from sidecar.blocks import BlockMeta, Buffer, Work
from sidecar.metrics import SidecarMetrics
from sidecar.store_disk import DiskWriter
from sidecar.store_tiers import TierIndex
from sidecar.wire import new_heap_buffer


class RegionSlots:
    """Slots and leases of `BlockStore`'s blocks in the shared region (if it has one)."""

    def __init__(
        self,
        *,
        index: TierIndex,
        lock: threading.Lock,
        writer: DiskWriter,
        arena: Arena | None,
        metrics: SidecarMetrics,
        get: Callable[..., tuple[BlockMeta, Buffer] | None],
    ) -> None:
        self._index = index
        self._lock = lock
        self._writer = writer
        self._arena = arena
        self._metrics = metrics
        self._memory_hits = metrics.hits.labels("memory")
        self._get = get  # the store's GET: a miss, a hit or a read from disk, counted

    # ---- shared memory --------------------------------------------------------------
    def new_buffer(self, n: int) -> Buffer:
        """Where a block of `n` bytes about to be received should go: a slot of the shared
        region when there is one with room, else the heap."""
        if self._arena is not None:
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
        arena, index = self._arena, self._index
        assert arena is not None
        slot = arena.alloc(n)
        while slot is None and n <= arena.size and index.mem_region:
            work = Work()
            with self._lock:  # the least recently used blocks leave memory, n bytes' worth
                before = index.mem_used
                index.evict_memory(work, target=max(0, min(before, index.memory_bytes) - n))
                evicted = before - index.mem_used
            self._writer.finish(work)  # spills written, evicted payloads let go
            slot = arena.alloc(n)
            if not evicted:
                break  # nothing left to evict: leases, sends or fragments hold the rest
        if slot is None:
            self._metrics.region_full.inc()
        return slot

    def lease(self, key: str) -> tuple[BlockMeta, Buffer] | bool | None:
        """A block's payload as a slot of the shared region, for an engine to copy from
        under a lease (the caller holds the returned slot until the lease ends). None on a
        miss; False when the block exists but no slot could be had for it (the engine
        reads it over TCP instead)."""
        assert self._arena is not None
        found = self._get(key, self._arena.alloc)  # (a packed block: unpacked into a slot)
        if found is None:
            return None
        meta, data = found
        if self._arena.holds(data):
            return meta, data
        slot = self._arena.alloc(len(data))  # (a read evicts nothing to make room)
        if slot is None:
            self._metrics.region_full.inc()
            return False
        slot[:] = memoryview(data).cast("B")
        with self._lock:  # later leases of this block need no copy
            self._index.to_slot(key, data, slot)  # type: ignore[arg-type]
        return meta, slot  # type: ignore[return-value]

    def lease_many(self, keys: list[str]) -> list[tuple[BlockMeta, Buffer, int] | bool | None]:
        """`lease` of each key, with the slot's offset in the region. Misses and blocks
        already in a slot (a load's usual keys) are found under one lock and counted once;
        the rest go through `lease`."""
        arena, index = self._arena, self._index
        assert arena is not None
        found: list[tuple[BlockMeta, Buffer, int] | bool | None] = []
        rest, hits, misses = [], 0, 0
        with self._lock:
            for i, key in enumerate(keys):
                e = index.blocks.get(key)
                if e is None:
                    misses += 1
                    found.append(None)
                elif e.in_mem and not e.packed and (at := arena.place(e.data)) is not None:
                    index.touch_mem(e)
                    hits += 1
                    found.append((e.meta, e.data, at))  # type: ignore[arg-type]
                else:
                    rest.append(i)
                    found.append(None)
        if misses:
            self._metrics.misses.inc(misses)
        if hits:
            self._memory_hits.inc(hits)
        for i in rest:
            got = self.lease(keys[i])
            if got:
                meta, slot = got  # type: ignore[misc]
                got = (meta, slot, arena.place(slot))  # type: ignore[assignment]
            found[i] = got  # type: ignore[assignment]
        return found
