"""vLLM's paged KV blocks <-> the built-in worker's KV tensors, in plain torch.

A vLLM attention layer's cache is a tensor whose first dimension is the block
(`[num_blocks, H, N, C]` in vLLM's standard per-layer view), but where a token's K and V
live inside a block is the attention backend's business: the CPU backend stores K
transposed for its `vec` kernels and VNNI-packed for `amx`, FlashAttention stores
`[N, H, 2*D]`. Rather than hard-code each backend, the connector **learns** the layout at
start-up: it writes a known pattern with the layer's own cache-write op
(`impl.do_kv_cache_update`, the op vLLM's forward pass uses) into a scratch block and reads
back where every `(k|v, token, head, dim)` landed. After that, loading and storing are one
gather or one scatter with an index tensor, on whatever device the cache lives on.

The connector's tensors are the built-in worker's `[2, L, H, T, D]` (K and V of every layer);
`worker.kv.layout.KVShape` turns them into LMCache's `KV_2LTD` payload on the wire.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Values written by the probe must be exact in the cache dtype (bf16 holds integers to 256).
_DIGIT_BASE = 128

CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""`(key [T, H, D], value [T, H, D], kv_cache, slot_mapping [T])`: the backend's cache write."""


class LayoutError(RuntimeError):
    """The cache's block layout could not be learned (quantised cache, unknown structure)."""


@dataclass(frozen=True)
class BlockLayout:
    """Where each element of one kernel block lives in that block's storage.

    `offsets[kv, n, h, d]` is the element offset, inside a block, of K (`kv=0`) or V (`kv=1`)
    of the block's `n`-th token, head `h`, channel `d`. A block's elements are the `elems`
    contiguous elements starting at `block * block_stride` from the cache's first element.
    """

    tokens: int  # tokens per kernel block (N)
    heads: int
    head_dim: int
    elems: int
    block_stride: int
    offsets: torch.Tensor  # int64 [2, N, H, D], on the cache's device

    def blocks_view(self, cache: torch.Tensor) -> torch.Tensor:
        """`cache` as `[num_blocks, elems]`: row b is block b's storage, physical order."""
        return cache.as_strided(
            (cache.shape[0], self.elems), (self.block_stride, 1), cache.storage_offset()
        )


def block_elems(cache: torch.Tensor) -> int:
    """Elements of one block if a block is one dense region of storage, else raise."""
    inner_shape, inner_stride = cache.shape[1:], cache.stride()[1:]
    span = 1 + sum((s - 1) * st for s, st in zip(inner_shape, inner_stride, strict=True))
    count = math.prod(inner_shape)
    if span != count:
        raise LayoutError(f"a cache block is not dense (shape {tuple(cache.shape)})")
    return count


def probe_layout(cache: torch.Tensor, write: CacheWriter, heads: int, head_dim: int) -> BlockLayout:
    """Learn `cache`'s block layout by writing a known pattern with `write` into a scratch
    block shaped and strided like one of `cache`'s blocks."""
    if cache.dim() != 4:
        raise LayoutError(f"expected a [blocks, heads, tokens, C] cache, got {tuple(cache.shape)}")
    tokens = int(cache.shape[2])
    elems = block_elems(cache)
    scratch_flat = torch.zeros(elems, dtype=cache.dtype, device=cache.device)
    scratch = scratch_flat.as_strided((1, *cache.shape[1:]), (elems, *cache.stride()[1:]))
    n_logical = 2 * tokens * heads * head_dim
    logical = torch.arange(n_logical, device=cache.device).view(2, tokens, heads, head_dim)
    slots = torch.arange(tokens, device=cache.device, dtype=torch.long)
    found = torch.zeros(elems, dtype=torch.long, device=cache.device)
    written = torch.zeros(elems, dtype=torch.bool, device=cache.device)
    passes = max(1, math.ceil(math.log(n_logical, _DIGIT_BASE)))
    scale = 1
    for _ in range(passes):
        digits = (logical // scale) % _DIGIT_BASE + 1  # 1.._DIGIT_BASE: 0 means "not written"
        scratch_flat.zero_()
        key = digits[0].to(cache.dtype)
        value = digits[1].to(cache.dtype)
        write(key.contiguous(), value.contiguous(), scratch, slots)
        got = scratch_flat.to(torch.float32).round().to(torch.long)
        written |= got > 0
        found += (got - 1).clamp(min=0) * scale
        scale *= _DIGIT_BASE
    places = written.nonzero().flatten()
    if places.numel() != n_logical:
        raise LayoutError(
            f"the cache write filled {places.numel()} of a block's elements, expected {n_logical}"
        )
    offsets = torch.full((n_logical,), -1, dtype=torch.long, device=cache.device)
    names = found[places]
    if int(names.max()) >= n_logical or int(names.min()) < 0:
        raise LayoutError("the cache write did not store the values it was given")
    offsets[names] = places
    if bool((offsets < 0).any()):
        raise LayoutError("two elements of a block landed in the same place")
    return BlockLayout(
        tokens=tokens,
        heads=heads,
        head_dim=head_dim,
        elems=elems,
        block_stride=int(cache.stride(0)),
        offsets=offsets.view(2, tokens, heads, head_dim),
    )


@dataclass(frozen=True)
class TokenSlots:
    """Where tokens `start..end` of a request live in the paged cache: a kernel block and
    an offset per token."""

    blocks: torch.Tensor  # int64 [T]
    within: torch.Tensor  # int64 [T]

    @property
    def count(self) -> int:
        return int(self.blocks.numel())


def token_slots(
    block_ids: list[int], block_size: int, kernel_tokens: int, start: int, end: int
) -> TokenSlots:
    """Slots of tokens `[start, end)` of a request whose (scheduler) blocks are `block_ids`.

    A scheduler block of `block_size` tokens may be several kernel blocks of `kernel_tokens`.
    """
    pos = torch.arange(start, end, dtype=torch.long)
    table = torch.tensor(block_ids, dtype=torch.long)
    per = block_size // kernel_tokens
    sched = table[pos // block_size]
    inner = pos % block_size
    return TokenSlots(sched * per + inner // kernel_tokens, inner % kernel_tokens)


def gather(
    caches: list[torch.Tensor], layouts: list[BlockLayout], slots: TokenSlots
) -> torch.Tensor:
    """K and V of `slots` from every layer as `[2, L, H, T, D]` (on the caches' device)."""
    out = []
    for cache, layout in zip(caches, layouts, strict=True):
        rows = slots.blocks.to(cache.device).view(1, -1, 1, 1)
        cols = layout.offsets[:, slots.within.to(cache.device)]  # [2, T, H, D]
        kv = layout.blocks_view(cache)[rows, cols]  # [2, T, H, D]
        out.append(kv.permute(0, 2, 1, 3))
    return torch.stack(out, dim=1)


def scatter(
    caches: list[torch.Tensor], layouts: list[BlockLayout], slots: TokenSlots, kv: torch.Tensor
) -> None:
    """Write `kv` (`[2, L, H, T, D]`) into `slots` of every layer's cache."""
    for layer, (cache, layout) in enumerate(zip(caches, layouts, strict=True)):
        rows = slots.blocks.to(cache.device).view(1, -1, 1, 1)
        cols = layout.offsets[:, slots.within.to(cache.device)]  # [2, T, H, D]
        src = kv[:, layer].permute(0, 2, 1, 3).to(cache.device, cache.dtype)  # [2, T, H, D]
        layout.blocks_view(cache)[rows, cols] = src
