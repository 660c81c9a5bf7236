"""Which sidecar blocks hold a request's prefix, and which to store when it finishes.

Plain Python, no vLLM: the same keys as the built-in worker (`worker.kv`). A sequence is
cut into `chunk_size`-token chunks whose hashes chain on the previous chunk's
(`chunk_hashes`, rooted at the request's `cache_salt`); each chunk is one block under an
LMCache `CacheEngineKey` carrying the request's tags (`s%<session key>`). After the last
full chunk, a **tail block** holds the rest of the sequence cut to a multiple of
`tail_tokens` (vLLM's block size by default), keyed by the chain hash of the previous chunk
and the tail's ids — what lets a cold session reuse all but less than one block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from worker.kv.hashing import KeyMaker, chain_hash, chunk_hashes


@dataclass(frozen=True, slots=True)
class Piece:
    """One sidecar block: `length` tokens of the sequence from token `begin`."""

    key: str
    begin: int
    length: int

    @property
    def end(self) -> int:
        return self.begin + self.length


@dataclass
class LoadSpec:
    """Scheduler -> worker: write tokens `[start, end)` of a request from `pieces`."""

    req_id: str
    start: int
    end: int
    pieces: list[Piece]
    block_ids: list[int] = field(default_factory=list)
    trace: dict[str, str] | None = None  # the request's W3C trace headers (tracing on)
    group: int = 0  # vLLM's KV cache group whose layers and blocks these are


@dataclass
class StoreSpec:
    """Scheduler -> worker: PUT `pieces` of a finished request, read from `block_ids`."""

    req_id: str
    session: str
    pieces: list[Piece]
    block_ids: list[int]
    trace: dict[str, str] | None = None  # the request's W3C trace headers (tracing on)
    group: int = 0  # vLLM's KV cache group whose layers and blocks these are


@dataclass
class Lookup:
    """The longest prefix the sidecar holds (`tokens`), the blocks that hold it, and every
    chunk key found (so the request's store skips them)."""

    tokens: int = 0
    pieces: list[Piece] = field(default_factory=list)
    found: set[str] = field(default_factory=set)


class Planner:
    def __init__(self, keys: KeyMaker, chunk_size: int, tail_tokens: int) -> None:
        if tail_tokens and chunk_size % tail_tokens:
            raise ValueError("tail_tokens must divide chunk_size")
        self.keys, self.chunk_size, self.tail_tokens = keys, chunk_size, tail_tokens

    def usable(self, tags: tuple[tuple[str, str], ...]) -> bool:
        return self.keys.fits(tags)

    def _chunks(
        self, ids: Sequence[int], limit: int, tags: tuple[tuple[str, str], ...], root: int
    ) -> list[tuple[Piece, int]]:
        """The full chunks of `ids[:limit]`, each with its chain hash."""
        size = self.chunk_size
        hashes = chunk_hashes(ids, size, limit, root)
        return [(Piece(self.keys.key(h, tags), i * size, size), h) for i, h in enumerate(hashes)]

    def _tail(
        self,
        ids: Sequence[int],
        start: int,
        length: int,
        prev: int,
        tags: tuple[tuple[str, str], ...],
    ) -> Piece:
        return Piece(
            self.keys.key(chain_hash(prev, ids[start : start + length]), tags), start, length
        )

    def lookup(
        self,
        ids: Sequence[int],
        usable: int,
        tags: tuple[tuple[str, str], ...],
        root: int,
        exists_many: Callable[[list[str]], list[bool]],
    ) -> Lookup:
        """Consecutive chunks from the first, then the longest tail block, up to `usable`
        tokens, asked of the sidecar in one call (`exists_many`, one pipelined round trip):
        every chunk that starts before `usable`, and the tail candidates at every chunk
        boundary, since which boundary the run of chunks reaches is known only from the
        answers."""
        candidates = self.candidates(ids, usable, tags, root)
        keys = candidates.asked()
        found = dict(zip(keys, exists_many(keys), strict=True)) if keys else {}
        return candidates.resolve(found)

    def candidates(
        self, ids: Sequence[int], usable: int, tags: tuple[tuple[str, str], ...], root: int
    ) -> Candidates:
        """The blocks a lookup asks about (`lookup`), before the sidecar answers."""
        chunks = [(p, h) for p, h in self._chunks(ids, len(ids), tags, root) if p.begin < usable]
        tails: list[tuple[int, list[Piece]]] = []  # (boundary, candidates longest first)
        gran = self.tail_tokens
        if gran:
            prev = root
            for i in range(len(chunks) + 1):
                start = i * self.chunk_size
                if start >= usable:
                    break
                longest = min(self.chunk_size - gran, (len(ids) - start) // gran * gran)
                cands = [
                    self._tail(ids, start, length, prev, tags)
                    for length in range(longest, 0, -gran)
                ]
                tails.append((i, cands))
                if i < len(chunks):
                    prev = chunks[i][1]
        return Candidates([p for p, _ in chunks], tails, usable)

    def stores(
        self,
        ids: Sequence[int],
        valid: int,
        tags: tuple[tuple[str, str], ...],
        root: int,
        skip: set[str],
    ) -> list[Piece]:
        """The blocks to PUT for the KV of `ids[:valid]`: every full chunk not in `skip`,
        then the tail cut to `tail_tokens`."""
        chunks = self._chunks(ids, valid, tags, root)
        out = [p for p, _ in chunks if p.key not in skip]
        prev = chunks[-1][1] if chunks else root
        start = len(chunks) * self.chunk_size
        if self.tail_tokens:
            length = (valid - start) // self.tail_tokens * self.tail_tokens
            if length:
                out.append(self._tail(ids, start, length, prev, tags))
        return out

    def load_specs(
        self,
        req_id: str,
        lookup: Lookup,
        num_external: int,
        blocks: Sequence[Sequence[int]],
        trace: dict[str, str] | None = None,
    ) -> list[LoadSpec]:
        """The load of tokens `[lookup.tokens - num_external, lookup.tokens)` into the
        request's blocks (`blocks[0]`: one KV cache group, all of them from its first token)."""
        start = lookup.tokens - num_external
        pieces = [p for p in lookup.pieces if p.end > start]
        return [LoadSpec(req_id, start, lookup.tokens, pieces, list(blocks[0]), trace)]

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
        """The stores of a finished request whose computed tokens are `ids` (`stores`)."""
        pieces = self.stores(ids, len(ids), tags, root, skip)
        return [StoreSpec(req_id, session, pieces, list(blocks[0]), trace)] if pieces else []


@dataclass
class Candidates:
    """A lookup's chunk keys and tail candidates (`Planner.candidates`), resolved against
    the sidecar's answers (`resolve`)."""

    chunks: list[Piece]
    tails: list[tuple[int, list[Piece]]]
    usable: int

    def asked(self) -> list[str]:
        return [p.key for p in self.chunks] + [t.key for _, c in self.tails for t in c]

    def resolve(self, found: dict[str, bool]) -> Lookup:
        """The longest run of found chunks from the first, then the longest found tail."""
        out = Lookup()
        for piece in self.chunks:
            if not found[piece.key]:
                break
            out.found.add(piece.key)
            out.pieces.append(piece)
            out.tokens = piece.end
        run = len(out.pieces)
        for boundary, cands in self.tails:
            if boundary == run and out.tokens < self.usable:
                tail = next((t for t in cands if found[t.key]), None)
                if tail is not None:
                    out.pieces.append(tail)
                    out.tokens = tail.end
        out.tokens = min(out.tokens, self.usable)
        return out


def session_of(tags: tuple[tuple[str, str], ...]) -> str | None:
    for name, value in tags:
        if name == "s":
            return value
    return None
