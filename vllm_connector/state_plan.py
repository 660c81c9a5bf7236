"""Lookups, loads and stores for a hybrid model whose layers keep a recurrent state beside
full attention (vLLM's `MambaSpec` groups: gated delta nets, Mamba; docs/vllm.md, "Hybrid
models: recurrent state").

Plain Python, no vLLM. A state layer's "KV" is one state per request, the state after
its last computed token, not per-token K and V: a hit of N tokens needs every full group's
KV of `[0, N)` **and** the state after exactly N tokens. So:

- **A store** (a finished request of V computed tokens, nothing in flight) puts every full
  group's 256-token chunks and an exact tail, `[V cut to a chunk, V)` — not cut to vLLM's
  block: the state exists at V only — and each state group's one block, the state after
  V tokens (vLLM's running state block, block `(V - 1) // block_size` of its table),
  keyed by the hash of `ids[:V]` (the chunk's hash where V ends one, else the tail hash:
  the hashes the full groups use), with the state layout's version and digest among its
  tags (`Group.state`).
- **A lookup** is two pipelined round trips: every full group's chunks, which give the run
  B (a chunk boundary); then, for every end E in `[B, B + chunk)` up to the usable end,
  each state group's state key and each full group's tail key. The hit is the longest E
  that every group has; nothing found there is a miss (a state stored below B is not
  looked for: a session's later turn covers its earlier ones).
- **A load** writes every full group's `[vLLM's own hit, N)`, and the state into the
  block vLLM allocated for the state after N tokens, `(N - 1) // block_size` of its table
  (what vLLM's `preprocess_mamba` reads a new request's initial state from).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_connector.group_plan import NULL_BLOCK, Group, GroupLookup, group_keys, prefix_hash
from vllm_connector.plan import LoadSpec, Lookup, Piece, Planner, StoreSpec
from worker.kv.hashing import KeyMaker, chain_hashes_each, chunk_hashes


def state_keys(keys: KeyMaker, group: Group) -> KeyMaker:
    """A state group's key space: `<model>#g<index>`, its layout's tag among every key's."""
    assert group.state is not None
    own = group_keys(keys, group)
    return KeyMaker(
        own.model, own.dtype, own.worker_id, own.world_size, (*keys.tags, ("rs", group.state))
    )


def state_block(blocks: Sequence[int], tokens: int, block_size: int) -> int:
    """The block of a state group's table that holds the state after `tokens` tokens."""
    index = (tokens - 1) // block_size
    return blocks[index] if 0 <= index < len(blocks) else NULL_BLOCK


class StatePlanner:
    """`plan.Planner`'s interface (`usable`, `lookup`, `load_specs`, `store_specs`) for a
    model of full-attention and recurrent-state groups (module docstring)."""

    def __init__(self, groups: Sequence[Group], keys: KeyMaker, chunk_size: int) -> None:
        self.groups = list(groups)
        self.chunk_size = chunk_size
        # full groups: chunks as a one-group model's, no tails on a grid (exact ones here)
        self.full = [
            (g, Planner(group_keys(keys, g), chunk_size, 0)) for g in groups if g.state is None
        ]
        self.states = [(g, state_keys(keys, g)) for g in groups if g.state is not None]
        assert self.full and self.states, "a state model has both kinds of group"

    def usable(self, tags: tuple[tuple[str, str], ...]) -> bool:
        return all(p.usable(tags) for _, p in self.full) and all(
            k.fits(tags) for _, k in self.states
        )

    def _hash(self, ids: Sequence[int], chunks: list[int], end: int, root: int) -> int:
        return prefix_hash(ids, chunks, end, root, self.chunk_size)

    def lookup(
        self,
        ids: Sequence[int],
        usable: int,
        tags: tuple[tuple[str, str], ...],
        root: int,
        exists_many: Callable[[list[str]], list[bool]],
    ) -> GroupLookup:
        """The longest prefix of `ids[:usable]` whose state and KV the sidecar holds."""
        size = self.chunk_size
        cands = [(g, p.candidates(ids, usable, tags, root)) for g, p in self.full]
        asked = [key for _, c in cands for key in c.asked()]
        found = dict(zip(asked, exists_many(asked), strict=True)) if asked else {}
        runs = {g.index: c.resolve(found) for g, c in cands}
        base = min(r.tokens for r in runs.values()) // size * size
        out = GroupLookup()
        out.found = {k for r in runs.values() for k in r.found}
        top = min(base + size - 1, usable)
        if top <= 0:
            return out
        chunks = chunk_hashes(ids, size, top, root)
        ends = range(top, max(base, 1) - 1, -1)
        # every end past `base` hashes on the chunk before it: one pass (chain_hashes_each)
        each = chain_hashes_each(chunks[base // size - 1] if base else root, ids[base:top])
        hashes = {e: each[e - base - 1] if e > base else chunks[e // size - 1] for e in ends}
        second = [k.key(hashes[e], tags) for e in ends for _, k in self.states]
        tails = {  # (the end on a chunk boundary is that chunk's, found in the first trip)
            (g.index, e): Piece(p.keys.key(hashes[e], tags), base, e - base)
            for e in ends
            if e > base
            for g, p in self.full
        }
        second += [t.key for t in tails.values()]
        have = dict(zip(second, exists_many(second), strict=True))
        for e in ends:
            if not all(have[k.key(hashes[e], tags)] for _, k in self.states):
                continue
            if e > base and not all(have[tails[g.index, e].key] for g, _ in self.full):
                continue
            for g, _ in self.full:
                pieces = [p for p in runs[g.index].pieces if p.end <= base]
                out.by_group[g.index] = pieces + ([tails[g.index, e]] if e > base else [])
            for g, k in self.states:
                out.by_group[g.index] = [Piece(k.key(hashes[e], tags), e, 0)]
            out.tokens = e
            break
        out.pieces = [p for pieces in out.by_group.values() for p in pieces]
        return out

    def load_specs(
        self,
        req_id: str,
        lookup: Lookup,
        num_external: int,
        blocks: Sequence[Sequence[int]],
        trace: dict[str, str] | None = None,
    ) -> list[LoadSpec]:
        """Each full group's `[start, end)` (start: vLLM's own hit), and each state group's
        state into the block vLLM reads the state after `end` tokens from."""
        assert isinstance(lookup, GroupLookup)
        end = lookup.tokens
        start = end - num_external
        out = []
        for g, _ in self.full:
            pieces = [p for p in lookup.by_group.get(g.index, []) if p.end > start]
            if pieces:
                out.append(
                    LoadSpec(req_id, start, end, pieces, list(blocks[g.index]), trace, g.index)
                )
        for g, _ in self.states:  # (no block, no piece: a load that fails, recomputed)
            block = state_block(blocks[g.index], end, g.block_size)
            held = [block] if block != NULL_BLOCK else []
            pieces = lookup.by_group.get(g.index, [])
            out.append(LoadSpec(req_id, end, end, pieces, held, trace, g.index))
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
        """Every full group's chunks (none of `skip`) and exact tail, and each state group's
        state after the last of `ids`; nothing when a state block is not held."""
        valid = len(ids)
        size = self.chunk_size
        held = {g.index: state_block(blocks[g.index], valid, g.block_size) for g, _ in self.states}
        if valid <= 0 or NULL_BLOCK in held.values():
            return []
        chunks = chunk_hashes(ids, size, valid, root)
        end_hash = self._hash(ids, chunks, valid, root)
        base = valid // size * size
        out = []
        for g, planner in self.full:
            pieces = planner.stores(ids, valid, tags, root, skip)
            if valid > base:
                pieces.append(Piece(planner.keys.key(end_hash, tags), base, valid - base))
            if pieces:
                full = list(blocks[g.index])
                out.append(StoreSpec(req_id, session, pieces, full, trace, g.index))
        for g, k in self.states:
            piece = Piece(k.key(end_hash, tags), valid, 0)
            out.append(StoreSpec(req_id, session, [piece], [held[g.index]], trace, g.index))
        return out
