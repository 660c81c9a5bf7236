"""Token ids, packed: little-endian uint32, 4 bytes a token — in Redis and on the wire.

On the manager API a list of token ids travels as the base64 of that packing: a session of
8,000 tokens is one 43 KB string to encode and decode, not 8,000 JSON numbers validated
one by one. Either form (a JSON list or the base64 string) is accepted on input.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterable
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer, PlainValidator

SMALL = 64  # below this many ids, plain Python checks and packs faster than numpy
_UINT32_MAX = 0xFFFFFFFF


def _small_ok(ids: list[int] | tuple[int, ...]) -> bool:
    """The same check as `_array`'s for a short list: ints (not bools) in uint32 range."""
    return all(type(i) is int and 0 <= i <= _UINT32_MAX for i in ids)


def _array(ids: Iterable[int]) -> np.ndarray:
    seq = ids if isinstance(ids, list | tuple | np.ndarray) else list(ids)
    arr = np.asarray(seq)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":  # bools, floats, strings, nesting
        raise ValueError("token ids must be integers")
    if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
        raise ValueError("token ids must fit in uint32")
    return arr


def pack_tokens(ids: Iterable[int]) -> bytes:
    if isinstance(ids, list | tuple) and len(ids) < SMALL and _small_ok(ids):
        return struct.pack(f"<{len(ids)}I", *ids)
    return _array(ids).astype("<u4").tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<u4").tolist()


def _validate(value: Any) -> list[int]:
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            raise ValueError("token ids: invalid base64") from None
        if len(raw) % 4:
            raise ValueError("token ids: not a whole number of uint32")
        return unpack_tokens(raw)
    if isinstance(value, list):
        if len(value) < SMALL and _small_ok(value):
            return value
        try:
            _array(value)  # vectorised type and range check
        except (ValueError, OverflowError, TypeError):
            raise ValueError("token ids must be integers in uint32 range") from None
        return value
    raise ValueError("token ids must be a list of integers or base64 of packed uint32")


def _serialize(value: list[int]) -> str:
    return base64.b64encode(pack_tokens(value)).decode()


TokenIds = Annotated[
    list[int],
    PlainValidator(_validate),
    PlainSerializer(_serialize, return_type=str, when_used="json"),
]
