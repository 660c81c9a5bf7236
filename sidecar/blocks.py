"""What the store keeps about a block, whichever tier holds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ctxcache.lmcache_keys import parse_key
from sidecar.protocol import FMT_ENGINE_BLOCKS, FMT_KV_2LTD, FMT_KV_MLA, Shape
from sidecar.wire import Buffer


@dataclass(frozen=True, slots=True)
class BlockMeta:
    key: str
    length: int
    fmt: int
    dtype: int
    shape: Shape

    @property
    def session(self) -> str | None:
        return session_of(self.key)

    @property
    def tokens(self) -> int:
        """Tokens of KV in the block: the T of a `KV_2LTD` `[2, L, T, D]` or `KV_MLA_FMT`
        `[1, L, T, D]` payload or of an engine-blocks one `(L, T, elems, tag)`, else 0."""
        if self.fmt in (FMT_KV_2LTD, FMT_KV_MLA):
            return self.shape[2]
        return self.shape[1] if self.fmt == FMT_ENGINE_BLOCKS else 0


def session_of(key: str) -> str | None:
    """The session a key's `s%<session key>` tag binds it to; None for untagged or foreign keys.

    The store treats keys as opaque: one that is not a `CacheEngineKey` (or is a
    layer-wise key, which `parse_key` does not accept) is stored, just not bound to a session.
    """
    if "%" not in key:
        return None
    try:
        return parse_key(key).session
    except ValueError:
        return None


@dataclass(slots=True, eq=False)
class Entry:
    meta: BlockMeta
    session: str | None
    pinned: bool = False
    data: Buffer | None = None  # the memory copy (kept while a spill is being written)
    in_mem: bool = False
    disk_path: Path | None = None  # set once the disk copy is written and counted
    spilling: bool = False
    readers: int = 0  # disk reads in progress: such a block is never dropped meanwhile
    footprint: int = 0  # what it takes against the budgets, if not its length (region slots)
    packed: bool = False  # `data` and the disk copy are `sidecar.coldkv`'s fp8 form

    @property
    def size(self) -> int:
        return self.footprint or self.meta.length


@dataclass(slots=True)
class Work:
    """What a locked section leaves for after the lock: files to delete, blocks to write."""

    trash: list[Path] = field(default_factory=list)
    spill: list[tuple[Entry, Buffer]] = field(default_factory=list)
