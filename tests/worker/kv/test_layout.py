from __future__ import annotations

import pytest
import torch

from sidecar.protocol import DTYPE_BFLOAT16, DTYPE_FLOAT32, FMT_KV_2LTD
from worker.kv.layout import KVShape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_2ltd_round_trip(dtype: torch.dtype) -> None:
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=dtype)
    kv = torch.randn(2, 3, 2, 5, 4).to(dtype)
    wire = shape.to_wire(kv)
    assert len(wire) == 5 * shape.bytes_per_token()
    # LMCache's layout: [2, L, T, H*D], token-major within a layer
    as_2ltd = torch.frombuffer(bytearray(wire), dtype=torch.uint8).view(dtype).view(2, 3, 5, 8)
    assert torch.equal(as_2ltd[1, 2, 4, 4:], kv[1, 2, 1, 4])
    code = DTYPE_FLOAT32 if dtype == torch.float32 else DTYPE_BFLOAT16
    back = shape.from_wire(bytearray(wire), FMT_KV_2LTD, code, (2, 3, 5, 8), 5)
    assert back is not None and torch.equal(back, kv)


def test_anything_else_is_rejected() -> None:
    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    wire = bytearray(shape.to_wire(torch.randn(2, 3, 2, 5, 4)))
    ok = (FMT_KV_2LTD, DTYPE_FLOAT32, (2, 3, 5, 8), 5)
    assert shape.from_wire(wire, *ok) is not None
    assert shape.from_wire(wire, 0, *ok[1:]) is None  # format
    assert shape.from_wire(wire, FMT_KV_2LTD, DTYPE_BFLOAT16, *ok[2:]) is None  # dtype
    assert shape.from_wire(wire, FMT_KV_2LTD, DTYPE_FLOAT32, (2, 3, 5, 8), 4) is None  # tokens
    assert shape.from_wire(wire[:-4], *ok) is None  # truncated payload
