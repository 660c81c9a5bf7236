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
    # (a `MambaSpec` group: recurrent state, one block per hit; `vllm_connector.state_plan`)
    # the version and digest of its state's layout, a tag of its keys; None: not a state
    state: str | None = None

    @property
    def kind(self) -> str:
        if self.state is not None:
            return f"recurrent state, {len(self.layers)} layers"
        if self.window is None:
            return f"full attention, {len(self.layers)} layers"
        return f"sliding window {self.window}, {len(self.layers)} layers"

    def hit_from(self, head: int) -> int:
        """The shortest hit for which vLLM keeps no block before token `head` (a block
        boundary) in this group: 0 for full attention."""
        return 0 if self.window is None else head + self.window - 1 + self.retained

    def first_kept(self, tokens: int) -> int:
        """The first token of the first block vLLM holds for this group once `tokens`
        tokens are computed (the blocks before it are its null block): 0 for full attention."""
        if self.window is None:
            return 0
        skipped = max(0, tokens - self.window + 1 - self.retained)
        return skipped // self.block_size * self.block_size


def prefix_hash(ids: Sequence[int], chunks: list[int], end: int, root: int, size: int) -> int:
    """The hash of the prefix `ids[:end]`: its chunk's where it ends one, else the tail hash
    of the chunk it ends in (`chunks`: the `size`-token chunk hashes, at least that far)."""
    whole = end // size
    if end % size == 0:
        return chunks[whole - 1]
    prev = chunks[whole - 1] if whole else root
    return chain_hash(prev, ids[whole * size : end])


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

    def _hash(self, ids: Sequence[int], chunks: list[int], end: int, root: int) -> int:
        return prefix_hash(ids, chunks, end, root, self.chunk_size)

    def _edges(self, limit: int) -> list[int]:
        """The ends up to `limit` where a sliding group's only hit may be off the unit grid
        (`store_specs`): E with E - (W - 1 + retained) on a block boundary."""
        residues = {
            (g.window - 1 + g.retained) % g.block_size
            for g, _ in self.sliding
            if g.window is not None and self.unit == g.block_size
        }
        bs = self.groups[0].block_size
        return [e for r in residues if r for e in range(r, limit + 1, bs)]

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
        unit, size = self.unit, self.chunk_size
        chunks = chunk_hashes(ids, size, len(ids), root)
        # a unit is asked for while it starts before `usable` (a hit inside it loads part)
        limit = min(len(ids), -(-usable // unit) * unit)
        grid = [self._hash(ids, chunks, e, root) for e in range(unit, limit + 1, unit)]
        edges = {e: self._hash(ids, chunks, e, root) for e in self._edges(usable)}
        full: list[tuple[Group, Candidates]] = []
        for g, planner in self.full:
            cands = planner.candidates(ids, usable, tags, root)
            keys = planner.keys
            for boundary, tails in cands.tails:  # the edge ends as tail candidates too
                begin = boundary * size
                tails += [
                    Piece(keys.key(h, tags), begin, e - begin)
                    for e, h in edges.items()
                    if begin < e < begin + size
                ]
                tails.sort(key=lambda t: -t.length)
            full.append((g, cands))
        units = {
            g.index: [Piece(k.key(h, tags), i * unit, unit) for i, h in enumerate(grid)]
            for g, k in self.sliding
        }
        parts = {
            g.index: {
                e: Piece(k.key(h, tags), e // unit * unit, e % unit) for e, h in edges.items()
            }
            for g, k in self.sliding
        }
        keys = [key for _, c in full for key in c.asked()]
        keys += [p.key for pieces in units.values() for p in pieces]
        keys += [p.key for pieces in parts.values() for p in pieces.values()]
        found = dict(zip(keys, exists_many(keys), strict=True)) if keys else {}
        out = GroupLookup()
        end = usable
        for g, cands in full:
            got = cands.resolve(found)
            out.found |= got.found
            out.by_group[g.index] = got.pieces
            end = min(end, got.tokens)
        windows = [
            _Window(
                g,
                units[g.index],
                {e: p for e, p in parts[g.index].items() if found[p.key]},
                [found[p.key] for p in units[g.index]],
                unit,
            )
            for g, _ in self.sliding
        ]
        for w in windows:
            out.found |= {p.key for p, ok in zip(w.units, w.have, strict=True) if ok}
        end = _sliding_end(end, windows, unit)
        for w in windows:
            out.by_group[w.group.index] = w.pieces(end) if end else []
        out.tokens = end
        out.pieces = [p for pieces in out.by_group.values() for p in pieces if p.begin < end]
        return out

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
        unit, size = self.unit, self.chunk_size
        chunks = chunk_hashes(ids, size, valid, root)
        pieces = {g.index: planner.stores(ids, valid, tags, root, skip) for g, planner in self.full}
        heads = {}  # sliding group -> the first token of the blocks vLLM still holds
        for g, keys in self.sliding:
            held = blocks[g.index]
            first = next((i for i, b in enumerate(held) if b != NULL_BLOCK), len(held))
            heads[g.index] = first * g.block_size
            pieces[g.index] = [
                piece
                for e in range(unit, valid + 1, unit)
                if e - unit >= heads[g.index]
                and (
                    piece := Piece(keys.key(self._hash(ids, chunks, e, root), tags), e - unit, unit)
                ).key
                not in skip
            ]
        # The hit a later turn makes on this store, `valid` cut to the unit, needs a block
        # vLLM has already freed when `valid - W + 1` is just past a block boundary; then
        # the shortest hit these blocks serve is stored too, off the grid: the edge end.
        edge = max((g.hit_from(heads[g.index]) for g, _ in self.sliding), default=0)
        if valid // unit * unit < edge <= valid and edge in self._edges(valid):
            h = self._hash(ids, chunks, edge, root)
            for g, planner in self.full:
                begin = edge // size * size
                pieces[g.index].append(Piece(planner.keys.key(h, tags), begin, edge - begin))
            for g, keys in self.sliding:
                if edge // unit * unit >= heads[g.index]:
                    pieces[g.index].append(
                        Piece(keys.key(h, tags), edge // unit * unit, edge % unit)
                    )
        return [
            StoreSpec(req_id, session, pieces[g.index], list(blocks[g.index]), trace, g.index)
            for g in self.groups
            if pieces[g.index]
        ]


@dataclass
class _Window:
    """A sliding group's units and edge pieces the sidecar has, for a lookup."""

    group: Group
    units: list[Piece]
    parts: dict[int, Piece]  # edge end -> its piece, where found
    have: list[bool]
    unit: int

    def __post_init__(self) -> None:
        self.runs = _run_starts(self.have)

    def _last(self, end: int) -> int:
        """The last whole unit a hit of `end` needs."""
        if end % self.unit and end not in self.parts:
            return end // self.unit  # the unit holding the hit's last token, whole
        return end // self.unit - 1

    def covers(self, end: int) -> bool:
        """Whether a hit of `end` finds every unit it needs, from the one holding the
        first token vLLM keeps to the end (the edge piece where `end` is one)."""
        first, last = self.group.first_kept(end) // self.unit, self._last(end)
        return last < first or (last < len(self.runs) and self.runs[last] <= first)

    def pieces(self, end: int) -> list[Piece]:
        first, last = self.group.first_kept(end) // self.unit, self._last(end)
        out = self.units[first : last + 1]
        if end % self.unit and end in self.parts:
            out.append(self.parts[end])
        return out


def _sliding_end(end: int, windows: list[_Window], unit: int) -> int:
    """The longest hit up to `end` that every sliding group covers; 0 if there is none.
    Below `end`, the hits tried are the unit boundaries and the edge ends."""
    edges = sorted({e for w in windows for e in w.parts if e < end}, reverse=True)
    while end > 0:
        if all(w.covers(end) for w in windows):
            return end
        below = (end - 1) // unit * unit
        while edges and edges[0] >= end:
            edges.pop(0)
        end = max(below, edges[0] if edges else 0)
    return 0


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
