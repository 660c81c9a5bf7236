"""The longest cached prefix of a request, and storing a finished sequence's KV.

Lookup order per request: L1 blocks (16 tokens) from the start, then sidecar chunks
(`chunk_size` tokens) from the first chunk the L1 does not cover, then (optionally) a
sidecar tail block — the last partial chunk of an earlier turn, stored at 16-token
granularity — so a cold session reuses all but < 16 tokens rather than all but < 256.
With `l1_tail_tokens` the L1 also keeps a finished sequence's last partial block (< 16
tokens), looked up right after the L1's full blocks: a hot session then reuses every token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from worker.kv.hashing import ROOT_HASH, KeyMaker, chain_hash, chunk_hashes
from worker.kv.l1 import L1Cache
from worker.kv.sidecar import SidecarKV, StoreJob

log = logging.getLogger(__name__)

BLOCK = 16  # L1 granularity, vLLM's default block size


@dataclass
class CachedPrefix:
    """KV for `ids[:tokens]` (`[2, L, H, tokens, D]`, None when nothing was reused)."""

    kv: torch.Tensor | None
    tokens: int = 0
    l1_tokens: int = 0
    sidecar_tokens: int = 0
    sidecar_chunks: set[int] = field(default_factory=set)  # chunk hashes already stored


class KVManager:
    def __init__(
        self,
        l1: L1Cache,
        sidecar: SidecarKV | None,
        keys: KeyMaker,
        chunk_size: int,
        *,
        tail_blocks: bool = True,
        l1_tail_tokens: bool = False,
    ) -> None:
        if chunk_size % BLOCK:
            raise ValueError(f"chunk size must be a multiple of {BLOCK}")
        self.l1, self.sidecar, self.keys = l1, sidecar, keys
        self.chunk_size = chunk_size
        self.tail_blocks = tail_blocks
        self.l1_tail_tokens = l1_tail_tokens

    def _sidecar_ok(self, tags: tuple[tuple[str, str], ...]) -> bool:
        if self.keys.fits(tags):
            return True
        log.warning("tags too long for LMCache's 150-character keys; not using the sidecar")
        return False

    def lookup(
        self, ids: list[int], tags: tuple[tuple[str, str], ...], root: int = ROOT_HASH
    ) -> CachedPrefix:
        """The longest cached prefix of `ids`, capped at len(ids) - 1 (one token is computed).

        `root` is the hash chain's root (`salt_root` of the request's `cache_salt`).
        """
        usable = len(ids) - 1
        blocks = chunk_hashes(ids, BLOCK, root=root)
        pieces = self.l1.get_prefix(blocks)
        got = len(pieces) * BLOCK
        if self.l1_tail_tokens and got < usable:
            prev = blocks[got // BLOCK - 1] if got else root
            got = self._l1_tail(ids, prev, got, usable, pieces)
        l1_tokens = got
        found: set[int] = set()
        after_tail = got % BLOCK != 0  # the L1 had the sequence's end: the sidecar has no more
        if self.sidecar is not None and not after_tail and got < usable and self._sidecar_ok(tags):
            got = self._from_sidecar(ids, tags, root, got, usable, pieces, found)
        if not pieces:
            return CachedPrefix(None)
        kv = torch.cat(pieces, dim=3) if len(pieces) > 1 else pieces[0]
        tokens = min(got, usable)
        return CachedPrefix(
            kv[:, :, :, :tokens],
            tokens,
            min(l1_tokens, tokens),
            tokens - min(l1_tokens, tokens),
            found,
        )

    def _from_sidecar(
        self,
        ids: list[int],
        tags: tuple[tuple[str, str], ...],
        root: int,
        got: int,
        usable: int,
        pieces: list[torch.Tensor],
        found: set[int],
    ) -> int:
        assert self.sidecar is not None
        size = self.chunk_size
        hashes = chunk_hashes(ids, size, root=root)
        c = got // size
        while c < len(hashes) and got < usable:
            block = self.sidecar.get(self.keys.key(hashes[c], tags), size)
            if block is None:
                break
            found.add(hashes[c])
            pieces.append(block[:, :, :, got - c * size :])
            got = (c + 1) * size
            c += 1
        if not self.tail_blocks or got >= usable:
            return got
        # a tail block: the last partial chunk an earlier turn stored, at 16-token steps
        start = c * size
        prev = hashes[c - 1] if c else root
        for length in range(min(size - BLOCK, (len(ids) - start) // BLOCK * BLOCK), 0, -BLOCK):
            if start + length <= got:
                break
            key = self.keys.key(chain_hash(prev, ids[start : start + length]), tags)
            if not self.sidecar.exists(key):
                continue
            block = self.sidecar.get(key, length)
            if block is not None:
                pieces.append(block[:, :, :, got - start :])
                got = start + length
            break
        return got

    def _l1_tail(
        self, ids: list[int], prev: int, got: int, usable: int, pieces: list[torch.Tensor]
    ) -> int:
        """The last partial block an earlier sequence left after `ids[:got]` (whose last
        full block hashes to `prev`), if any: `l1_tail_tokens`."""
        for length in range(min(BLOCK - 1, usable - got), 0, -1):
            block = self.l1.get(chain_hash(prev, ids[got : got + length]))
            if block is not None:
                pieces.append(block)
                return got + length
        return got

    def store(
        self,
        ids: list[int],
        kv: torch.Tensor,
        tags: tuple[tuple[str, str], ...],
        prefix: CachedPrefix,
        session: str,
        root: int = ROOT_HASH,
    ) -> None:
        """Put the KV of `ids[:T]` (`kv` is `[2, L, H, T, D]`, owned) into L1 and the sidecar."""
        tokens = int(kv.shape[3])
        blocks = chunk_hashes(ids, BLOCK, tokens, root)
        for i, h in enumerate(blocks):
            if h not in self.l1:
                self.l1.put(h, kv[:, :, :, i * BLOCK : (i + 1) * BLOCK].clone())
        start = len(blocks) * BLOCK
        if self.l1_tail_tokens and start < tokens:
            h = chain_hash(blocks[-1] if blocks else root, ids[start:tokens])
            self.l1.put(h, kv[:, :, :, start:tokens].clone())
        if self.sidecar is None or not self._sidecar_ok(tags):
            return
        size = self.chunk_size
        blocks: list[tuple[str, torch.Tensor]] = []
        hashes = chunk_hashes(ids, size, tokens, root)
        for i, h in enumerate(hashes):
            if h not in prefix.sidecar_chunks:
                blocks.append((self.keys.key(h, tags), kv[:, :, :, i * size : (i + 1) * size]))
        start = len(hashes) * size
        tail = (tokens - start) // BLOCK * BLOCK
        if self.tail_blocks and tail:
            prev = hashes[-1] if hashes else root
            h = chain_hash(prev, ids[start : start + tail])
            blocks.append((self.keys.key(h, tags), kv[:, :, :, start : start + tail]))
        if blocks:
            self.sidecar.submit(StoreJob(blocks, session))
