"""The digests a conversation's states are found by (docs/implicit.md, "Matching").

A request's messages are read in canonical form (`gateway.resent.canonical`: what of a
message the client echoes back the same, whatever else it adds or drops). The digest of
the first k messages chains the digest of the first k-1 with the k-th message, seeded with
the match key: the tenant, the model, the tools the prompt renders, the client's
`cache_salt` and `prompt_cache_key`. Two requests share a digest only if all of that and
every message up to there is the same; nothing matches across tenants.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from gateway.resent import canonical

Messages = list[dict[str, Any]]


def seed(
    tenant: str, model: str, tools: Any, cache_key: str | None, cache_salt: Any = None
) -> bytes:
    """The match key, as the digest chain's seed."""
    h = hashlib.blake2b(digest_size=16, person=b"ctxcache-implct")
    for part in (tenant, model, cache_key or "", cache_salt if isinstance(cache_salt, str) else ""):
        h.update(part.encode() + b"\0")
    h.update(orjson.dumps(tools or None, option=orjson.OPT_SORT_KEYS))
    return h.digest()


def chain(start: bytes, messages: Messages) -> list[str | None]:
    """The digest of each prefix of `messages` (entry k-1: the first k), as hex; None from
    the first message that has no canonical form on (nested past any sense, say): no state
    can be found past it."""
    out: list[str | None] = []
    digest: bytes | None = start
    for message in messages:
        if digest is not None:
            digest = extend(digest, message)
        out.append(digest.hex() if digest is not None else None)
    return out


def extend(digest: bytes, message: Any) -> bytes | None:
    """The digest of a prefix one message longer."""
    if not isinstance(message, dict):
        return None
    encoded = _encode(canonical(message))
    if encoded is None:
        return None
    return hashlib.blake2b(digest + encoded, digest_size=16).digest()


def after(digest_hex: str, message: dict[str, Any]) -> str | None:
    """`extend` of a hex digest, as hex (a state: the request's messages and the answer)."""
    digest = extend(bytes.fromhex(digest_hex), message)
    return digest.hex() if digest is not None else None


def _encode(value: Any, depth: int = 0) -> bytes | None:
    """A canonical form as bytes, unambiguously (type-tagged, length-prefixed); None if it
    holds anything else than JSON's scalars and tuples (`canonical` marks what it will not
    compare with an `object()`)."""
    if depth > 64:
        return None
    if value is None or isinstance(value, bool):
        return b"n" if value is None else (b"t" if value else b"f")
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return b"s%d:" % len(data) + data
    if isinstance(value, bytes):
        return b"b%d:" % len(value) + value
    if isinstance(value, int):
        return b"i%d;" % value
    if isinstance(value, float):
        return b"d" + repr(value).encode() + b";"
    if isinstance(value, tuple):
        parts = [_encode(v, depth + 1) for v in value]
        if any(p is None for p in parts):
            return None
        return b"(%d:" % len(parts) + b"".join(parts) + b")"  # type: ignore[arg-type]
    return None
