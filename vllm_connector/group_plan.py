"""Lookups, loads and stores for a model of several KV cache groups (vLLM's hybrid KV
cache manager): full-attention groups and sliding-window groups (docs/vllm.md, "Hybrid
models").

Plain Python, no vLLM. Each group has its own key space — the model field of its keys is
`<model>#g<group>` — and its own payload: `KV_2LTD` of the group's layers only.

- A **full-attention group** is stored and looked up as a one-group model is
  (`plan.Planner`): 256-token chunks chained from the first, then a tail block.
- A **sliding-window group** of window W needs, for a hit of N tokens, only the blocks vLLM
  keeps for it once N tokens are computed: from the block holding token `N - W + 1` (vLLM's
  `SlidingWindowManager.get_num_skipped_tokens`) to N. Its KV is stored in **units** of
  `unit` tokens (the tail granularity: vLLM's block size), the unit ending at token E keyed
  by the hash of the prefix up to E (the chunk's hash where E ends a chunk, else the tail
  hash of the chunk it is in: the same hashes the full groups use). A finished request
  stores the units of its blocks vLLM still holds (the last window; the blocks before it
  vLLM has freed, and their ids are its null block, 0).

A lookup asks, in one pipelined round trip, for every full group's chunk and tail keys and
every sliding group's units up to the usable end; the hit is the longest N, at most every
full group's run, such that each sliding group has all the units from the one holding its
first kept token to N.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_connector.plan import Candidates, LoadSpec, Lookup, Piece, Planner, StoreSpec
from worker.kv.hashing import KeyMaker, chain_hash, chunk_hashes

NULL_BLOCK = 0  # vLLM's null block (`BlockPool.null_block`: the pool's first block)


@dataclass(frozen=True)
class Group:
    """One KV cache group the connector serves: vLLM's index of it, its layers, its block
    size, and its window (None: full attention)."""

    index: int
    layers: tuple[str, ...]
    block_size: int
    window: int | None = None
    retained: int = 0  # SlidingWindowSpec.extra_retained_tokens: kept below the window

    @property
    def kind(self) -> str:
        if self.window is None:
            return f"full attention, {len(self.layers)} layers"
        return f"sliding window {self.window}, {len(self.layers)} layers"

    def first_kept(self, tokens: int) -> int:
        """The first token of the first block vLLM holds for this group once `tokens`
        tokens are computed (the blocks before it are its null block): 0 for full attention."""
        if self.window is None:
            return 0
        skipped = max(0, tokens - self.window + 1 - self.retained)
        return skipped // self.block_size * self.block_size


def group_keys(keys: KeyMaker, group: Group) -> KeyMaker:
    """The key space of one group of a hybrid model: `<model>#g<index>`."""
    return KeyMaker(f"{keys.model}#g{group.index}", keys.dtype, keys.worker_id, keys.world_size)


@dataclass
class GroupLookup(Lookup):
    """A lookup over every group: `tokens` is the hit of all of them; `by_group`, the
    pieces each group loads from (`pieces`: all of them, for counting)."""

    by_group: dict[int, list[Piece]] = field(default_factory=dict)


class GroupPlanner:
    """`plan.Planner`'s interface (`usable`, `lookup`, `load_specs`, `store_specs`) for a
    model of several KV cache groups."""

    def __init__(
        self, groups: Sequence[Group], keys: KeyMaker, chunk_size: int, tail_tokens: int
    ) -> None:
        self.groups = list(groups)
        self.chunk_size = chunk_size
        self.unit = tail_tokens or chunk_size
        self.full = [
            (g, Planner(group_keys(keys, g), chunk_size, tail_tokens))
            for g in self.groups
            if g.window is None
        ]
        self.sliding = [(g, group_keys(keys, g)) for g in self.groups if g.window is not None]

    def usable(self, tags: tuple[tuple[str, str], ...]) -> bool:
        return all(p.usable(tags) for _, p in self.full) and all(
            k.fits(tags) for _, k in self.sliding
        )

    def _units(self, ids: Sequence[int], limit: int, root: int) -> list[int]:
        """The prefix hash at every unit boundary E = unit, 2 unit, ... up to `limit`."""
        size, unit = self.chunk_size, self.unit
        chunks = chunk_hashes(ids, size, limit, root)
        out: list[int] = []
        for end in range(unit, limit + 1, unit):
            whole = end // size
            if end % size == 0:
                out.append(chunks[whole - 1])
            else:
                prev = chunks[whole - 1] if whole else root
                out.append(chain_hash(prev, ids[whole * size : end]))
        return out

    def lookup(
        self,
        ids: Sequence[int],
        usable: int,
        tags: tuple[tuple[str, str], ...],
        root: int,
        exists_many: Callable[[list[str]], list[bool]],
    ) -> GroupLookup:
        """The longest prefix of `ids[:usable]` every group can load (module docstring),
        asked of the sidecar in one call."""
        full: list[tuple[Group, Candidates]] = [
            (g, p.candidates(ids, usable, tags, root)) for g, p in self.full
        ]
        unit = self.unit
        # a unit is asked for while it starts before `usable` (a hit inside it loads part)
        limit = min(len(ids), -(-usable // unit) * unit)
        hashes = self._units(ids, limit, root)
        units = {
            g.index: [Piece(k.key(h, tags), i * unit, unit) for i, h in enumerate(hashes)]
            for g, k in self.sliding
        }
        keys = [key for _, c in full for key in c.asked()]
        keys += [p.key for pieces in units.values() for p in pieces]
        found = dict(zip(keys, exists_many(keys), strict=True)) if keys else {}
        out = GroupLookup()
        end = usable
        for g, cands in full:
            got = cands.resolve(found)
            out.found |= got.found
            out.by_group[g.index] = got.pieces
            end = min(end, got.tokens)
        runs: dict[int, list[int]] = {}
        for g, _ in self.sliding:
            have = [found[p.key] for p in units[g.index]]
            out.found |= {p.key for p, ok in zip(units[g.index], have, strict=True) if ok}
            runs[g.index] = _run_starts(have)
        end = self._sliding_end(end, runs)
        for g, _ in self.sliding:
            first = g.first_kept(end) // unit
            out.by_group[g.index] = units[g.index][first : -(-end // unit)] if end else []
        out.tokens = end
        out.pieces = [p for pieces in out.by_group.values() for p in pieces if p.begin < end]
        return out

    def _sliding_end(self, end: int, runs: dict[int, list[int]]) -> int:
        """The longest hit up to `end` whose every sliding group has all its units, from the
        one holding its first kept token to the hit's end; 0 if there is none."""
        unit = self.unit
        while end > 0:
            last = -(-end // unit) - 1  # the unit holding the hit's last token
            if all(
                last < len(runs[g.index]) and runs[g.index][last] <= g.first_kept(end) // unit
                for g, _ in self.sliding
            ):
                return end
            end = last * unit  # the next hit to try: the unit boundary below
        return 0

    def load_specs(
        self,
        req_id: str,
        lookup: Lookup,
        num_external: int,
        blocks: Sequence[Sequence[int]],
        trace: dict[str, str] | None = None,
    ) -> list[LoadSpec]:
        """One load per group, into its blocks: tokens `[start, end)` for a full group
        (start: vLLM's own hit), from the first token vLLM keeps for a sliding group."""
        assert isinstance(lookup, GroupLookup)
        end = lookup.tokens
        start = end - num_external
        out = []
        for g in self.groups:
            begin = max(start, g.first_kept(end))
            pieces = [p for p in lookup.by_group.get(g.index, []) if p.end > begin]
            if begin < end and pieces:
                out.append(
                    LoadSpec(req_id, begin, end, pieces, list(blocks[g.index]), trace, g.index)
                )
        return out

    def store_specs(
        self,
        req_id: str,
        session: str,
        ids: Sequence[int],
        tags: tuple[tuple[str, str], ...],
        root: int,
        skip: set[str],
        blocks: Sequence[Sequence[int]],
        trace: dict[str, str] | None = None,
    ) -> list[StoreSpec]:
        """Every full group's chunks and tail; every sliding group's units that lie in the
        blocks vLLM still holds for it (none of `skip`, the keys the lookup found)."""
        valid = len(ids)
        out = []
        for g, planner in self.full:
            pieces = planner.stores(ids, valid, tags, root, skip)
            if pieces:
                out.append(
                    StoreSpec(req_id, session, pieces, list(blocks[g.index]), trace, g.index)
                )
        if self.sliding:
            unit = self.unit
            hashes = self._units(ids, valid, root)
            for g, keys in self.sliding:
                held = list(blocks[g.index])
                first = next((i for i, b in enumerate(held) if b != NULL_BLOCK), len(held))
                pieces = [
                    piece
                    for i, h in enumerate(hashes)
                    if i * unit >= first * g.block_size
                    and (piece := Piece(keys.key(h, tags), i * unit, unit)).key not in skip
                ]
                if pieces:
                    out.append(StoreSpec(req_id, session, pieces, held, trace, g.index))
        return out


def _run_starts(have: list[bool]) -> list[int]:
    """For each unit i, the first unit of the run of found units that ends at i (i + 1
    where unit i is missing)."""
    out: list[int] = []
    start = 0
    for i, ok in enumerate(have):
        if not ok:
            start = i + 1
        out.append(start)
    return out
