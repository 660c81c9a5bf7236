"""The store's side of the shared region (`RegionOps`, a base of
`sidecar.store.BlockStore`), used when an engine runs on this node (docs/sidecar.md, "Local
data path"): where a block about to be received goes (`new_buffer`, `alloc_slot`: a slot of
the region, the memory tier letting blocks go to make one), and a block's place in the
region for an engine's lease (`lease`, `lease_many`: a block still in the heap is copied
into a slot on its first lease).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sidecar.blocks import BlockMeta, Buffer, Work
from sidecar.store_disk import DiskOps
from sidecar.wire import new_heap_buffer


class RegionOps(DiskOps):
    """Slots and leases of `BlockStore` (its base)."""

    if TYPE_CHECKING:

        def get(self, key: str) -> tuple[BlockMeta, Buffer] | None: ...  # BlockStore's

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
