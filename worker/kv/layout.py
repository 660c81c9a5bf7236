"""KV tensors in the worker, and LMCache's `KV_2LTD` payload on the wire.

In the worker a sequence's KV is one tensor `[2, num_layers, num_kv_heads, tokens, head_dim]`
(K and V of every layer, the layout attention reads). The sidecar stores LMCache's
`KV_2LTD`: `[2, num_layers, tokens, num_kv_heads * head_dim]`, row-major, native byte order.

An MLA model's cache (the vLLM connector's, `vllm_connector.mla`) is one latent plane, not
two: `planes=1`, one "head" of `kv_lora_rank + qk_rope_head_dim` channels, and on the wire
LMCache's `KV_MLA_FMT`, `[1, num_layers, tokens, latent]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# LMCache's `lmcache.v1.protocol` integers, as the sidecar protocol carries them.
from sidecar.protocol import (
    DTYPE_BFLOAT16,
    DTYPE_FLOAT8_E4M3FN,
    DTYPE_FLOAT8_E5M2,
    DTYPE_FLOAT16,
    DTYPE_FLOAT32,
    FMT_KV_2LTD,
    FMT_KV_MLA,
)

TORCH_TO_CODE: dict[torch.dtype, int] = {
    torch.float32: DTYPE_FLOAT32,
    torch.bfloat16: DTYPE_BFLOAT16,
    torch.float16: DTYPE_FLOAT16,  # what LMCache writes for half
    # an fp8 KV cache's bytes as they are (vllm_connector.kvdtype)
    torch.float8_e4m3fn: DTYPE_FLOAT8_E4M3FN,
    torch.float8_e5m2: DTYPE_FLOAT8_E5M2,
}
# names LMCache writes in a key's dtype field (lmcache.utils.TORCH_DTYPE_TO_STR_DTYPE)
TORCH_TO_KEY_NAME: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.bfloat16: "bfloat16",
    torch.float16: "half",
    torch.float8_e4m3fn: "fp8_e4m3fn",
    torch.float8_e5m2: "fp8_e5m2",
}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    planes: int = 2  # K and V; 1: MLA's latent (`KV_MLA_FMT` on the wire)

    @property
    def dtype_code(self) -> int:
        return TORCH_TO_CODE[self.dtype]

    @property
    def fmt(self) -> int:
        """The payload's LMCache format: `KV_2LTD`, or `KV_MLA_FMT` for one latent plane."""
        return FMT_KV_MLA if self.planes == 1 else FMT_KV_2LTD

    def bytes_per_token(self) -> int:
        per_plane = self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return self.planes * per_plane

    def wire_shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (self.planes, self.num_layers, tokens, self.num_kv_heads * self.head_dim)

    def to_wire(self, kv: torch.Tensor) -> memoryview:
        """`[P, L, H, T, D]` -> the bytes of `[P, L, T, H*D]` (P: `planes`)."""
        two, layers, heads, tokens, dim = kv.shape
        flat = kv.permute(0, 1, 3, 2, 4).reshape(two, layers, tokens, heads * dim).contiguous()
        return memoryview(flat.view(torch.uint8).numpy()).cast("B")

    def from_wire(
        self,
        data: memoryview | bytearray,
        fmt: int,
        dtype: int,
        shape: tuple[int, int, int, int],
        tokens: int,
    ) -> torch.Tensor | None:
        """A block from the sidecar as `[P, L, H, T, D]`, or None if it is not what we wrote."""
        if fmt != self.fmt or dtype != self.dtype_code:
            return None
        if tuple(shape) != self.wire_shape(tokens):
            return None
        if len(data) != tokens * self.bytes_per_token():
            return None
        buf = data if isinstance(data, bytearray) else bytearray(data)  # torch wants writable
        flat = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
        kv = flat.view(self.planes, self.num_layers, tokens, self.num_kv_heads, self.head_dim)
        return kv.permute(0, 1, 3, 2, 4)
