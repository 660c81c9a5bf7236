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


@dataclass
class StoreSpec:
    """Scheduler -> worker: PUT `pieces` of a finished request, read from `block_ids`."""

    req_id: str
    session: str
    pieces: list[Piece]
    block_ids: list[int]
    trace: dict[str, str] | None = None  # the request's W3C trace headers (tracing on)


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
        keys = [p.key for p, _ in chunks] + [t.key for _, cands in tails for t in cands]
        found = dict(zip(keys, exists_many(keys), strict=True)) if keys else {}
        out = Lookup()
        for piece, _ in chunks:
            if not found[piece.key]:
                break
            out.found.add(piece.key)
            out.pieces.append(piece)
            out.tokens = piece.end
        run = len(out.pieces)
        for boundary, cands in tails:
            if boundary == run and out.tokens < usable:
                tail = next((t for t in cands if found[t.key]), None)
                if tail is not None:
                    out.pieces.append(tail)
                    out.tokens = tail.end
        out.tokens = min(out.tokens, usable)
        return out

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


def session_of(tags: tuple[tuple[str, str], ...]) -> str | None:
    for name, value in tags:
        if name == "s":
            return value
    return None
