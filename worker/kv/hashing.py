"""Prefix-chained token hashes, deterministic across processes (no salted `hash()`).

A chunk's hash covers the previous chunk's hash and this chunk's ids, so equal hashes
mean equal prefixes (up to a 128-bit blake2b collision). The same chain is used at two
granularities: 16-token blocks for the L1, `--chunk-size` chunks for the sidecar.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from ctxcache.lmcache_keys import MAX_KEY_LENGTH, CacheKey, key_fits

ROOT_HASH = 0
_HASH_BYTES = 16


def chain_hash(prev: int, ids: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(prev.to_bytes(_HASH_BYTES, "little"))
    h.update(np.asarray(ids, dtype="<i4").tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes_each(prev: int, ids: Sequence[int]) -> list[int]:
    """`chain_hash(prev, ids[:k])` for every k from 1 to len(ids), in one pass: blake2b is a
    stream, so each is a copy of the running hash after one more id."""
    h = hashlib.blake2b(digest_size=_HASH_BYTES)
    h.update(prev.to_bytes(_HASH_BYTES, "little"))
    out: list[int] = []
    for token in np.asarray(ids, dtype="<i4"):
        h.update(token.tobytes())
        out.append(int.from_bytes(h.copy().digest(), "little"))
    return out


def salt_root(salt: str | None) -> int:
    """The chain's root for a request's `cache_salt` (vLLM's field): ROOT_HASH without one.

    Requests with different salts share no hash, so no cached prefix — what keeps one
    tenant's prompts from being probed through another's cache hits.
    """
    if salt is None:
        return ROOT_HASH
    digest = hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=_HASH_BYTES)
    return int.from_bytes(digest.digest(), "little")


def chunk_hashes(
    ids: Sequence[int], size: int, limit: int | None = None, root: int = ROOT_HASH
) -> list[int]:
    """Hashes of the full `size`-token chunks of `ids[:limit]`, each chained on the last."""
    end = len(ids) if limit is None else min(limit, len(ids))
    out: list[int] = []
    prev = root
    for start in range(0, end - size + 1, size):
        prev = chain_hash(prev, ids[start : start + size])
        out.append(prev)
    return out


class KeyMaker:
    """LMCache `CacheEngineKey` strings for this worker's model, dtype and a request's tags."""

    def __init__(
        self,
        model: str,
        dtype: str,
        worker_id: int,
        world_size: int = 1,
        tags: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.model = model.replace("@", "_")
        self.dtype = dtype
        self.worker_id = worker_id
        self.world_size = world_size
        self.tags = tags  # every key's own, before a request's (a payload format's version)

    def fits(self, tags: tuple[tuple[str, str], ...]) -> bool:
        """Whether keys with these tags fit LMCache's key field (150 bytes of UTF-8, as the
        sidecar counts them: a non-ASCII tag takes more bytes than characters)."""
        return key_fits(self._string((1 << 128) - 1, tags))

    def _string(self, chunk_hash: int, tags: tuple[tuple[str, str], ...]) -> str:
        key = CacheKey(
            self.model, self.world_size, self.worker_id, chunk_hash, self.dtype, self.tags + tags
        )
        return key.to_string()

    def key(self, chunk_hash: int, tags: tuple[tuple[str, str], ...]) -> str:
        s = self._string(chunk_hash, tags)
        if not key_fits(s):
            raise ValueError(f"cache key longer than {MAX_KEY_LENGTH} bytes")
        return s
