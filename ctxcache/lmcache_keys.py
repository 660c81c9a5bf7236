"""LMCache `CacheEngineKey` strings, as lmcache 0.5.6 writes and parses them.

`model@world_size@worker_id@chunk_hash_hex@dtype[@tag%value...]` — see
`lmcache.utils.CacheEngineKey.to_string/from_string`. Tags come from a request's
`kv_transfer_params` entries named `lmcache.tag.<name>`; ctxcache binds a block to a
session with the tag `s%<session key>`. The worker builds these keys, the sidecar parses
them; both use this module so the format lives in one place.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

MAX_KEY_LENGTH = 150  # lmcache.v1.protocol.MAX_KEY_LENGTH: the key field of the header, in
# UTF-8 bytes (what lm:// and the sidecar's local path check: `key_fits`)
TAG_PREFIX = "lmcache.tag."
SESSION_TAG = "s"
DTYPE_NAMES = (
    "half",
    "bfloat16",
    "float",
    "double",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "fp8_e4m3fn",
    "fp8_e4m3fnuz",
    "fp8_e5m2",
    "fp8_e5m2fnuz",
)


@dataclass(frozen=True, slots=True)
class CacheKey:
    model: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str
    tags: tuple[tuple[str, str], ...] = field(default=())
    layer: int | None = None  # LMCache's layer-wise keys (LayerCacheEngineKey) carry one

    def to_string(self) -> str:
        s = f"{self.model}@{self.world_size}@{self.worker_id}@{self.chunk_hash:x}@{self.dtype}"
        if self.layer is not None:
            s += f"@{self.layer}"
        if self.tags:
            s += "@" + "@".join(f"{k}%{v}" for k, v in self.tags)
        return s

    @property
    def session(self) -> str | None:
        """The session key this block is bound to, if any."""
        for k, v in self.tags:
            if k == SESSION_TAG:
                return v
        return None


def key_fits(key: str) -> bool:
    """Whether `key` fits LMCache's key field: at most `MAX_KEY_LENGTH` bytes of UTF-8 (a
    key with a character UTF-8 cannot encode, a lone surrogate, fits nowhere)."""
    try:
        return len(key.encode()) <= MAX_KEY_LENGTH
    except UnicodeEncodeError:
        return False


def tags_from_params(kv_transfer_params: dict[str, object] | None) -> tuple[tuple[str, str], ...]:
    """`{"lmcache.tag.s": "abc"}` -> `(("s", "abc"),)`, in the request's order (like LMCache)."""
    if not kv_transfer_params:
        return ()
    out: list[tuple[str, str]] = []
    for k, v in kv_transfer_params.items():
        if k.startswith(TAG_PREFIX):
            name, value = k[len(TAG_PREFIX) :], str(v)
            if "@" in name + value or "%" in name:
                raise ValueError(f"tag {k!r} may not contain '@' or '%' in its name")
            out.append((name, value))
    return tuple(out)


def parse_key(s: str) -> CacheKey:
    """Parse a key string; raises ValueError on anything LMCache would not produce."""
    parts = s.split("@")
    if len(parts) < 5:
        raise ValueError(f"invalid cache key: {s!r}")
    tags: list[tuple[str, str]] = []
    layer = None
    rest = parts[5:]
    if rest and rest[0].isdigit():  # model@ws@id@hash@dtype@<layer>[@tags]
        layer, rest = int(rest[0]), rest[1:]
    for kv in rest:
        name, sep, value = kv.partition("%")
        if not sep:
            raise ValueError(f"invalid tag in cache key: {s!r}")
        tags.append((name, value))
    return CacheKey(
        model=parts[0],
        world_size=int(parts[1]),
        worker_id=int(parts[2]),
        chunk_hash=int(parts[3], 16),
        dtype=parts[4],
        tags=tuple(tags),
        layer=layer,
    )


def session_key(session_id: str) -> str:
    """The key that tags a session's KV blocks in the sidecar.

    A digest of the session id rather than the id itself: anyone who can list sidecar keys
    must not learn ids that grant access to conversations.
    """
    return hashlib.sha256(session_id.encode()).hexdigest()[:32]
