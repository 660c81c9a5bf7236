"""Learning a paged cache's block layout from its own write op, then gather and scatter.

The CPU backend's real write op (`cpu_attn_reshape_and_cache`, every ISA it has here) and a
FlashAttention-shaped layout written in plain torch: a block's layout is learned, not known.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.utils import require_vllm
from vllm_connector.layout import (
    LayoutError,
    block_elems,
    gather,
    probe_layout,
    scatter,
    token_slots,
)

BLOCKS, HEADS, TOKENS, DIM, LAYERS = 6, 2, 128, 32, 3
Writer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def cpu_writer(isa: str) -> Writer:
    """What vLLM's CPU attention does in `do_kv_cache_update`, for one ISA."""
    require_vllm()
    from vllm import _custom_ops as ops

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        blocks, heads, tokens, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)

    return write


def flash_writer(
    k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """FlashAttention's `[B, H, N, 2*D]` view whose storage is `[B, N, H, 2*D]`."""
    key_cache, value_cache = cache.transpose(1, 2).split(DIM, dim=-1)  # [B, N, H, D] each
    blocks, tokens = slots // TOKENS, slots % TOKENS
    key_cache[blocks, tokens] = k
    value_cache[blocks, tokens] = v


def flash_cache(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(BLOCKS, TOKENS, HEADS, 2 * DIM, dtype=dtype).transpose(1, 2)


def cpu_cache(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(BLOCKS, HEADS, TOKENS, 2 * DIM, dtype=dtype)


CASES = [
    ("amx", torch.bfloat16, cpu_cache),
    ("vec", torch.float32, cpu_cache),
    ("vec", torch.bfloat16, cpu_cache),
    ("vec16", torch.float32, cpu_cache),
    ("flash", torch.bfloat16, flash_cache),
    ("flash", torch.float16, flash_cache),
]


def writer_for(isa: str) -> Writer:
    if isa == "amx" and not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU")
    return flash_writer if isa == "flash" else cpu_writer(isa)


@pytest.mark.parametrize(("isa", "dtype", "make"), CASES)
def test_gather_reads_what_the_backend_wrote_and_scatter_writes_what_it_would(
    isa: str, dtype: torch.dtype, make: Callable[[torch.dtype], torch.Tensor]
) -> None:
    write = writer_for(isa)
    caches = [make(dtype) for _ in range(LAYERS)]
    layout = probe_layout(caches[0], write, HEADS, DIM)
    layouts = [layout] * LAYERS
    gen = torch.Generator().manual_seed(0)
    tokens = 200  # a block and a half: a partial block too
    keys = [torch.randn(tokens, HEADS, DIM, generator=gen).to(dtype) for _ in caches]
    values = [torch.randn(tokens, HEADS, DIM, generator=gen).to(dtype) for _ in caches]
    src = token_slots([4, 1], TOKENS, TOKENS, 0, tokens)
    for cache, k, v in zip(caches, keys, values, strict=True):
        write(k, v, cache, src.blocks * TOKENS + src.within)

    kv = gather(caches, layouts, src)  # [2, L, H, T, D]
    expected = torch.stack(
        [
            torch.stack([k.transpose(0, 1), v.transpose(0, 1)])
            for k, v in zip(keys, values, strict=True)
        ],
        dim=1,
    )
    assert torch.equal(kv, expected)

    ours = [make(dtype) for _ in range(LAYERS)]
    theirs = [make(dtype) for _ in range(LAYERS)]
    dst = token_slots([2, 5], TOKENS, TOKENS, 0, tokens)
    scatter(ours, layouts, dst, kv)
    for cache, k, v in zip(theirs, keys, values, strict=True):
        write(k, v, cache, dst.blocks * TOKENS + dst.within)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_range_that_starts_inside_a_block() -> None:
    caches = [flash_cache(torch.float32)]
    layout = probe_layout(caches[0], flash_writer, HEADS, DIM)
    kv = torch.randn(2, 1, HEADS, 70, DIM)
    slots = token_slots([3, 0], TOKENS, TOKENS, 100, 170)  # crosses from block 3 into block 0
    scatter(caches, [layout], slots, kv)
    assert torch.equal(gather(caches, [layout], slots), kv)
    assert torch.equal(slots.blocks[:28], torch.full((28,), 3))
    assert torch.equal(slots.blocks[28:], torch.zeros(42, dtype=torch.long))


def test_kernel_blocks_smaller_than_the_schedulers() -> None:
    """A scheduler block of 128 tokens may be several kernel blocks (here 4 of 32)."""
    slots = token_slots([2], 128, 32, 0, 128)
    assert slots.blocks.tolist() == [8] * 32 + [9] * 32 + [10] * 32 + [11] * 32
    assert slots.within.tolist() == list(range(32)) * 4


def test_a_write_that_loses_values_is_refused() -> None:
    def lossy(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        flash_writer(k, v * 0, cache, slots)  # V never lands: like a quantising cache

    with pytest.raises(LayoutError):
        probe_layout(flash_cache(torch.float32), lossy, HEADS, DIM)


def test_a_block_that_is_not_dense_is_refused() -> None:
    sparse = torch.zeros(BLOCKS, HEADS, TOKENS, 4 * DIM)[..., : 2 * DIM]
    with pytest.raises(LayoutError):
        block_elems(sparse)
