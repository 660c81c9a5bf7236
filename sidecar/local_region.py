"""An engine's mapping of the sidecar's region and the leases it holds in it: `Region`
(the region mapped read-write), `ReadLease` (a read lease's blocks, as the client sees it)
and `WriteLease` (slots to write into). `sidecar.local_client.LocalClient` makes them; the
vLLM connector copies through their views (`vllm_connector.shm_loads`, `stores`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from sidecar.arena import MAGIC, MAP_FLAGS, read_generation
from sidecar.local_protocol import Slot


@dataclass
class ReadLease:
    """A read lease's blocks; end it with `release`."""

    id: int
    generation: str
    blocks: list[Slot | str | None]  # per key: a slot, TCP, or None (a miss)
    region: Region | None = None  # the mapping its slots are in
    sent: float = 0.0  # (monotonic) before the lease was asked for: it holds past this
    # + the sidecar's lease timeout
    conn: int = 0  # the connection it came on (the client's count of its connections)

    def view(self, slot: Slot) -> memoryview:
        assert self.region is not None
        return self.region.view[slot.offset : slot.offset + slot.length]


@dataclass
class WriteLease:
    """Slots to write blocks into; end it with `commit` or `abort`."""

    id: int
    generation: str
    slots: list[Slot]
    region: Region

    def view(self, slot: Slot) -> memoryview:
        return self.region.view[slot.offset : slot.offset + slot.length]


class Region:
    """The sidecar's region, mapped read-write (stores write into it)."""

    def __init__(self, path: Path, size: int, generation: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                raise OSError(f"{path} is smaller than the sidecar says")
            self.map = mmap.mmap(fd, size, MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if self.map[: len(MAGIC)] != MAGIC or read_generation(path) != generation:
            self.map.close()
            raise OSError(f"{path} is not generation {generation}'s region")
        self.path, self.size, self.generation = path, size, generation
        self.view = memoryview(self.map)

    def close(self) -> None:
        """Let the mapping go: it is unmapped when the last reference to it does. Never
        `mmap.close()` here: `torch.frombuffer` (the connector's view of the region) keeps
        a reference to the mmap but no buffer export, so an explicit close would unmap
        memory a live tensor still points into (a segfault at its next use)."""
        with contextlib.suppress(BufferError):  # slices of it still exported
            self.view.release()
