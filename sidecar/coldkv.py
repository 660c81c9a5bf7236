"""Opt-in fp8 compression of the KV the sidecar keeps (`CTX_SIDECAR_COLD_KV=fp8`).

A block whose payload is an array of bf16, fp16 or fp32 KV in a layout we know (LMCache's
`KV_2LTD` `[2, L, T, D]`, or the connector's engine blocks `[L, blocks, elems]`) is kept
as fp8 (e4m3) with one float32 scale per row: a token's K (or V) of one layer, all heads
(`KV_2LTD`), or one kernel block of one layer (engine blocks). A GET gets the block back
in its own dtype, shape and length, so no client can tell, except by the values: each
element is within fp8's rounding of the original (relative error at most 2^-4 of its
value, plus 2^-9 of its row's absolute maximum for the values fp8 holds only as subnormals).
Anything else (an fp8 or other 1-byte payload, a format we do not know, a length that does
not match the shape, a payload with a non-finite value) is kept as it came.

The packed payload: a 16-byte header (`CKV8`, version, the source dtype code, the row
count and row length), the scales (`float32[rows]`), then the fp8 elements
(`[rows, row_elems]`), all little-endian. `unpack` checks every field against the block's
header and the packed length, and raises `BadPacked` on anything that does not add up:
the store takes that for a miss, never for KV.

docs/sidecar.md ("Compressed tiers") has the decisions, and docs/benchmarks.md what they
cost and change. torch is imported here only: a sidecar without the setting never needs it.
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Literal

import numpy as np

from sidecar.blocks import BlockMeta
from sidecar.protocol import (
    DTYPE_BFLOAT16,
    DTYPE_FLOAT16,
    DTYPE_FLOAT32,
    DTYPE_HALF,
    FMT_ENGINE_BLOCKS,
    FMT_KV_2LTD,
)
from sidecar.wire import Buffer, new_heap_buffer

ColdKV = Literal["off", "fp8"]
Granularity = Literal["token", "chunk"]

MAGIC = b"CKV8"
VERSION = 1
HEADER = struct.Struct("<4sBBHII")  # magic, version, source dtype, 0, rows, row elements
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_ITEMSIZE = {DTYPE_HALF: 2, DTYPE_FLOAT16: 2, DTYPE_BFLOAT16: 2, DTYPE_FLOAT32: 4}


class BadPacked(ValueError):
    """A packed payload that does not match its block: a miss."""


def require() -> None:
    """Fail at start, not at the first PUT, where torch (the packing's only need) is missing."""
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "CTX_SIDECAR_COLD_KV=fp8 needs torch installed beside the sidecar"
        ) from exc


def _torch_dtype(code: int) -> Any:
    import torch

    return {
        DTYPE_HALF: torch.float16,
        DTYPE_FLOAT16: torch.float16,
        DTYPE_BFLOAT16: torch.bfloat16,
        DTYPE_FLOAT32: torch.float32,
    }[code]


def rows_of(meta: BlockMeta, granularity: Granularity = "token") -> tuple[int, int] | None:
    """(rows, row elements) a block's payload is scaled by, or None when it is not one we
    compress: another dtype (fp8 and every 1-byte dtype among them), another format, or a
    length that does not match its shape."""
    itemsize = _ITEMSIZE.get(meta.dtype)
    if itemsize is None or meta.length <= 0 or meta.length % itemsize:
        return None
    elems = meta.length // itemsize
    if meta.fmt == FMT_KV_2LTD:
        two, layers, tokens, dim = meta.shape
        if min(two, layers, tokens, dim) <= 0 or two * layers * tokens * dim != elems:
            return None
        return (two * layers, tokens * dim) if granularity == "chunk" else (elems // dim, dim)
    if meta.fmt == FMT_ENGINE_BLOCKS:
        row = meta.shape[2]  # (layers, tokens, elems, tag): rows of `elems`, one per block
        if row <= 0 or elems % row:
            return None
        return elems // row, row
    return None


def packed_length(rows: int, row_elems: int) -> int:
    return HEADER.size + 4 * rows + rows * row_elems


def pack(meta: BlockMeta, data: Buffer, granularity: Granularity = "token") -> bytearray | None:
    """The packed form of a block's payload, or None: keep it as it is (`rows_of`, or a
    non-finite value in it)."""
    shape = rows_of(meta, granularity)
    if shape is None or len(data) != meta.length:
        return None
    import torch

    rows, row_elems = shape
    raw = torch.frombuffer(_writable(data), dtype=torch.uint8)
    x = raw.view(_torch_dtype(meta.dtype)).view(rows, row_elems).to(torch.float32)
    scales = x.abs().amax(dim=1, keepdim=True).div_(FP8_MAX)
    if not bool(torch.isfinite(scales).all()):
        return None  # inf or nan in the KV: kept as it came, never rounded into fp8
    scales.clamp_(min=torch.finfo(torch.float32).tiny)  # an all-zero row: any scale works
    q = x.div_(scales).to(torch.float8_e4m3fn)
    out = bytearray(packed_length(rows, row_elems))
    HEADER.pack_into(out, 0, MAGIC, VERSION, meta.dtype, 0, rows, row_elems)
    at = HEADER.size
    dst = torch.frombuffer(out, dtype=torch.uint8)
    dst[at : at + 4 * rows].view(torch.float32).copy_(scales.view(-1))
    dst[at + 4 * rows :].copy_(q.view(-1).view(torch.uint8))
    return out


def unpack(meta: BlockMeta, packed: Buffer, out: Buffer | None = None) -> Buffer:
    """A packed payload back in the block's dtype: `meta.length` bytes, into `out` (a
    writable buffer of that length, e.g. a slot of the shared region) or a new one.
    Raises BadPacked when the packed bytes are not a block of this header."""
    import torch

    view = _writable(packed)
    if len(view) < HEADER.size:
        raise BadPacked("shorter than its header")
    magic, version, dtype, _zero, rows, row_elems = HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise BadPacked("not a packed block of this version")
    itemsize = _ITEMSIZE.get(dtype)
    if dtype != meta.dtype or itemsize is None:
        raise BadPacked(f"packed from dtype {dtype}, the block says {meta.dtype}")
    if rows * row_elems * itemsize != meta.length or len(view) != packed_length(rows, row_elems):
        raise BadPacked("rows do not match the block's length")
    src = torch.frombuffer(view, dtype=torch.uint8)
    at = HEADER.size
    scales = src[at : at + 4 * rows].view(torch.float32).view(rows, 1)
    if not bool((torch.isfinite(scales) & (scales > 0)).all()):
        raise BadPacked("a scale is not a positive finite number")
    q = np.frombuffer(view, dtype=np.uint8, offset=at + 4 * rows)
    result: Buffer = new_heap_buffer(meta.length) if out is None else out
    dst = np.frombuffer(memoryview(result).cast("B"), dtype=np.uint8)
    # fp8 -> the dtype by a 256-entry table (numpy's `take`: ~5x torch's element-wise
    # conversion here), then the row's scale, in place
    if dtype == DTYPE_BFLOAT16:  # bf16 has fp32's range: scaled in bf16, rounding 2^-9
        np.take(_table("bfloat16"), q, out=dst.view(np.int16))
        rows_view = torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16)
        rows_view.view(rows, row_elems).mul_(scales.to(torch.bfloat16))
    elif dtype == DTYPE_FLOAT32:
        np.take(_table("float32"), q, out=dst.view(np.int32))
        torch.from_numpy(dst.view(np.float32)).view(rows, row_elems).mul_(scales)
    else:  # fp16's range is narrow: scaled in fp32, then rounded once
        wide = torch.from_numpy(_table("float32")[q].view(np.float32)).view(rows, row_elems)
        torch.from_numpy(dst.view(np.float16)).view(rows, row_elems).copy_(wide.mul_(scales))
    return result


@functools.cache
def _table(dtype: str) -> np.ndarray:
    """Every fp8 (e4m3) value as the bits of `dtype` (exact: each e4m3 value is one)."""
    import torch

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    if dtype == "bfloat16":
        return codes.to(torch.bfloat16).view(torch.int16).numpy().copy()
    return codes.to(torch.float32).view(torch.int32).numpy().copy()


def _writable(data: Buffer) -> memoryview:
    """The bytes of `data` as a flat view torch may wrap without a warning: read-only
    buffers (an encrypted disk read's `bytes`) are copied."""
    view = memoryview(data).cast("B")
    return memoryview(bytearray(view)) if view.readonly else view
