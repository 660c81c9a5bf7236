"""LMCache's `lm://` remote-storage wire format, byte-compatible with lmcache 0.5.6.

See `lmcache/v1/protocol.py` (`ClientMetaMessage`, `ServerMetaMessage`) and
`lmcache/v1/server/__main__.py`. Every frame starts with a fixed header in native byte
order; PUT carries `length` payload bytes after its header and gets no reply; GET is
answered by a reply header, then the payload when the code is SUCCESS. LMCache's server
answers a miss, EXIST and HEALTH with `length=0, fmt=1, dtype=2 (float16), shape=0`,
and so do we. LMCache 0.5.6 leaves LIST unimplemented on both sides; we answer it with
a SUCCESS header whose `length` counts the newline-separated key list that follows
(the shape LMCache's commented-out server code sketches).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

MAX_KEY_LENGTH = 150
REQUEST = struct.Struct(f"iiiiiiiii{MAX_KEY_LENGTH}s")  # 186 bytes
REPLY = struct.Struct("iiiiiiiii")  # 36 bytes


class Command(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


class Code(IntEnum):
    SUCCESS = 200
    FAIL = 400


# lmcache.v1.protocol.DTYPE_TO_INT / INT_TO_DTYPE. torch.half *is* torch.float16, so that
# dict maps it to 2: LMCache writes 2 for float16 and reads both 1 and 2 as float16.
DTYPE_NONE = 0
DTYPE_HALF = 1
DTYPE_FLOAT16 = 2
DTYPE_BFLOAT16 = 3
DTYPE_FLOAT32 = 4
DTYPE_FLOAT64 = 5
DTYPE_UINT8 = 6
DTYPE_FLOAT8_E4M3FN = 7
DTYPE_FLOAT8_E5M2 = 8

# lmcache.v1.memory_management.MemoryFormat
FMT_UNDEFINED = 0
FMT_KV_2LTD = 1  # [2, num_layers, num_tokens, hidden_dim]
FMT_BINARY = 4  # opaque bytes: the vLLM connector's recurrent-state blocks (state_worker.py)
FMT_KV_MLA = 6  # KV_MLA_FMT: [1, num_layers, num_tokens, latent] (an MLA model's one plane)
# ctxcache's own, not one of LMCache's formats: an engine's KV cache blocks as its kernels
# store them, `[num_layers, blocks, elems]`, with shape (layers, tokens, elems, layout tag).
# Written by the vLLM connector through a local sidecar; only an engine with the same layout
# tag reads it (vllm_connector/blockcopy.py), anything else takes it for a miss.
FMT_ENGINE_BLOCKS = 1001

Shape = tuple[int, int, int, int]
ZERO_SHAPE: Shape = (0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Request:
    command: int
    length: int
    fmt: int
    dtype: int
    location: int
    shape: Shape
    key: str


def pack_request(
    command: int,
    key: str,
    *,
    length: int = 0,
    fmt: int = FMT_KV_2LTD,
    dtype: int = DTYPE_FLOAT16,
    shape: Shape = ZERO_SHAPE,
    location: int = 0,
) -> bytes:
    """A request header exactly as `ClientMetaMessage.serialize` writes it."""
    raw = key.encode()
    if len(raw) > MAX_KEY_LENGTH:
        raise ValueError(f"key is {len(raw)} bytes, the protocol allows {MAX_KEY_LENGTH}")
    return REQUEST.pack(command, length, fmt, dtype, location, *shape, raw.ljust(MAX_KEY_LENGTH))


def unpack_request(buf: bytes | bytearray | memoryview) -> Request:
    command, length, fmt, dtype, location, s0, s1, s2, s3, key = REQUEST.unpack(buf)
    return Request(command, length, fmt, dtype, location, (s0, s1, s2, s3), decode_key(key))


def decode_key(raw: bytes) -> str:
    """The key field of a request header as a string."""
    # LMCache pads with spaces (ljust); struct pads with NULs: accept both, like its .strip().
    return raw.rstrip(b"\x00").decode("utf-8", errors="replace").strip()


def pack_reply(
    code: int,
    *,
    length: int = 0,
    fmt: int = FMT_KV_2LTD,
    dtype: int = DTYPE_FLOAT16,
    shape: Shape = ZERO_SHAPE,
    location: int = 0,
) -> bytes:
    """A reply header exactly as `ServerMetaMessage.serialize` writes it."""
    return REPLY.pack(code, length, fmt, dtype, *shape, location)


@dataclass(frozen=True, slots=True)
class Reply:
    code: int
    length: int
    fmt: int
    dtype: int
    shape: Shape
    location: int


def unpack_reply(buf: bytes | bytearray | memoryview) -> Reply:
    code, length, fmt, dtype, s0, s1, s2, s3, location = REPLY.unpack(buf)
    return Reply(code, length, fmt, dtype, (s0, s1, s2, s3), location)


# Replies that never change, packed once.
REPLY_MISS = pack_reply(Code.FAIL)
REPLY_OK = pack_reply(Code.SUCCESS)
