"""vLLM's paged KV blocks <-> the built-in worker's KV tensors, in plain torch.

A vLLM attention layer's cache is a tensor whose first dimension is the block
(`[num_blocks, H, N, C]` in vLLM's standard per-layer view), but where a token's K and V
live inside a block is the attention backend's business: the CPU backend stores K
transposed for its `vec` kernels and VNNI-packed for `amx`, FlashAttention stores
`[N, H, 2*D]`. Rather than hard-code each backend, the connector **learns** the layout at
start-up: it writes a known pattern with the layer's own cache-write op
(`impl.do_kv_cache_update`, the op vLLM's forward pass uses) into a scratch block and reads
back where every `(k|v, token, head, dim)` landed.

Moving tokens with one int64 index per element runs at about 1 GB/s, so `gather` and
`scatter` keep that indexed path for the tokens of partly covered blocks only. Every layout
seen so far (CPU `vec`/`vec16` K transposed, `amx` VNNI-packed, FlashAttention's interleave)
is *affine once each of token, head and channel is split into a few factors* (`amx` K: token
= 16 x 16, channel = pairs), so whole blocks move through two strided views of the same
shape and one `copy_` (K and V in one where a view holds both, as FlashAttention's does),
with the channel factor that is contiguous on both sides read as one wider integer (a bf16
pair as int32, four as int64): a `copy_` runs at a rate in elements, not bytes. Blocks whose
ids are scattered go through one staging copy of their rows; a layout that is not affine
falls back to one small per-block index.

The connector's tensors are the built-in worker's `[2, L, H, T, D]` (K and V of every layer);
`worker.kv.layout.KVShape` turns them into LMCache's `KV_2LTD` payload on the wire. An MLA
cache has one latent plane instead of two (`[1, L, 1, T, latent]`, LMCache's `KV_MLA_FMT` on
the wire); its layout is learned with its own write (`vllm_connector.mla`) and moves the same.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

# Values written by the probe must be exact in the cache dtype: bf16 holds integers to 256,
# fp8 e4m3 to 16, e5m2 to 8 (so an fp8 cache takes a smaller base and more passes).
_DIGIT_BASE = 128
_FP8_DIGIT_BASE = {torch.float8_e4m3fn: 16, torch.float8_e4m3fnuz: 16, torch.float8_e5m2: 8}


def _digit_base(dtype: torch.dtype) -> int:
    """The probe's digit base in `dtype` (its digits are 1..base)."""
    return _FP8_DIGIT_BASE.get(dtype, _DIGIT_BASE)


CacheWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""`(key [T, H, D], value [T, H, D], kv_cache, slot_mapping [T])`: the backend's cache write."""


class LayoutError(RuntimeError):
    """The cache's block layout could not be learned (quantised cache, unknown structure)."""


@dataclass(frozen=True)
class BlockLayout:
    """Where each element of one kernel block lives in that block's storage.

    `offsets[kv, n, h, d]` is the element offset, inside a block, of K (`kv=0`) or V (`kv=1`)
    of the block's `n`-th token, head `h`, channel `d` (an MLA cache: one plane, its latent).
    A block's elements are the `elems` contiguous elements starting at `block * block_stride`
    from the cache's first element.
    """

    tokens: int  # tokens per kernel block (N)
    heads: int
    head_dim: int
    elems: int
    block_stride: int
    offsets: torch.Tensor  # int64 [2, N, H, D] ([1, N, 1, D]: MLA), on the cache's device

    @property
    def planes(self) -> int:
        """2 (K and V), or 1 (an MLA cache's latent)."""
        return int(self.offsets.shape[0])

    def blocks_view(self, cache: torch.Tensor) -> torch.Tensor:
        """`cache` as `[num_blocks, elems]`: row b is block b's storage, physical order."""
        return cache.as_strided(
            (cache.shape[0], self.elems), (self.block_stride, 1), cache.storage_offset()
        )

    @functools.cached_property
    def affine(self) -> tuple[AffineView | None, ...]:
        """The block as strided views: one over K and V together (`[2, N, H, D]`) where there
        is one, else one for K and one for V (`[N, H, D]`, None where that is not affine)."""
        both = affine_view(self.offsets)
        if both is not None or self.planes == 1:
            return (both,)
        return affine_view(self.offsets[0]), affine_view(self.offsets[1])


@dataclass(frozen=True)
class AffineView:
    """Offsets as a strided view: element `(i, j, ...)` lives at `base` plus, for each axis,
    its index's digits in that axis's factors times their strides (`axes[a]` =
    `((size, stride), ...)`, outer factor first)."""

    base: int
    axes: tuple[tuple[tuple[int, int], ...], ...]


def _factors(line: list[int]) -> list[tuple[int, int]] | None:
    """`line[i] - line[0]` as `(size, stride)` factors of `i` (outer first), or None: an
    affine run of `p` steps, repeated `len(line) / p` times at offsets that are themselves
    factored the same way. The caller checks the result against every element."""
    if len(line) == 1:
        return [(1, 0)]
    step, run = line[1] - line[0], 2
    while run < len(line) and line[run] - line[run - 1] == step:
        run += 1
    if run == len(line):
        return [(run, step)]
    outer = _factors(line[::run]) if len(line) % run == 0 else None
    return None if outer is None else [*outer, (run, step)]


def affine_view(offsets: torch.Tensor) -> AffineView | None:
    """`offsets` (any shape) as an AffineView, if it is one."""
    offs = offsets.cpu()
    base = int(offs.flatten()[0])
    axes = []
    for dim in range(offs.dim()):
        line = offs[tuple(slice(None) if i == dim else 0 for i in range(offs.dim()))]
        axis = _factors([int(v) - base for v in line])
        if axis is None or min(stride for _, stride in axis) < 0:
            return None
        axes.append(tuple(axis))
    expect = torch.full(offs.shape, base, dtype=torch.long)
    for dim, axis in enumerate(axes):
        pos, along = torch.arange(offs.shape[dim]), torch.zeros(offs.shape[dim], dtype=torch.long)
        for size, stride in reversed(axis):
            along += (pos % size) * stride
            pos = pos // size
        expect += along.view([-1 if i == dim else 1 for i in range(offs.dim())])
    return AffineView(base, tuple(axes)) if torch.equal(expect, offs) else None


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
    base = _digit_base(cache.dtype)
    passes = max(1, math.ceil(math.log(n_logical, base)))
    scale = 1
    for _ in range(passes):
        digits = (logical // scale) % base + 1  # 1..base: 0 means "not written"
        scratch_flat.zero_()
        key = digits[0].to(cache.dtype)
        value = digits[1].to(cache.dtype)
        write(key.contiguous(), value.contiguous(), scratch, slots)
        got = scratch_flat.to(torch.float32).round().to(torch.long)
        written |= got > 0
        found += (got - 1).clamp(min=0) * scale
        scale *= base
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


# Whole blocks are copied straight into the cache while their ids are consecutive, or on
# CPU while their runs of consecutive ids hold this many bytes on average; other blocks go
# through one staging copy of their rows (on CUDA a copy per run costs a launch and Python).
_DIRECT_RUN_BYTES = 256 * 1024
# A copy whose destination's contiguous axis is this short is issued once per index of it.
_SPLIT_INNER = 4
_WIDE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Run(NamedTuple):
    """Whole kernel blocks `ids` holding tokens `start..`; `pieces`: `block_runs(ids)`."""

    start: int
    ids: list[int]
    pieces: list[tuple[int, int, int]]


def block_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """`ids` as runs `(index in ids, first id, count)` of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, block, 1))
    return runs


def _whole_blocks(slots: TokenSlots, tokens: int) -> tuple[list[_Run], torch.Tensor]:
    """The slots' whole kernel blocks, and the indices of the other tokens."""
    blocks, within = slots.blocks.cpu(), slots.within.cpu()
    count = blocks.numel()
    if count < tokens:
        return [], torch.arange(count)
    steps = (within[1:] == within[:-1] + 1) & (blocks[1:] == blocks[:-1])
    breaks = torch.cat([torch.zeros(1, dtype=torch.long), (~steps).long().cumsum(0)])
    last = count - tokens + 1
    starts = ((within[:last] == 0) & (breaks[tokens - 1 :] == breaks[:last])).nonzero().flatten()
    covered = torch.zeros(count + 1, dtype=torch.long)
    covered[starts] = 1
    covered[starts + tokens] -= 1
    rest = (covered.cumsum(0)[:count] == 0).nonzero().flatten()
    groups: list[tuple[int, list[int]]] = []
    for start, block in zip(starts.tolist(), blocks[starts].tolist(), strict=True):
        if groups and groups[-1][0] + len(groups[-1][1]) * tokens == start:
            groups[-1][1].append(block)
        else:
            groups.append((start, [block]))
    return [_Run(start, ids, block_runs(ids)) for start, ids in groups], rest


class _Plan(NamedTuple):
    """An AffineView ready to view: the block side's sizes and strides, and per factor the
    logical axis it splits and the size of the factors inside it."""

    base: int
    sizes: list[int]
    strides: list[int]
    logical: list[tuple[int, int]]


@functools.cache
def _plans(view: AffineView, itemsize: int) -> tuple[int, _Plan, _Plan]:
    """`view` as a plan in elements, and in integers `group` elements wide where the channel
    axis's inner factor is contiguous (a `copy_` runs at a rate in elements, not bytes)."""
    size, stride = view.axes[-1][-1]
    group = 1
    while stride == 1 and size % (group * 2) == 0 and group * 2 * itemsize <= 8:
        group *= 2
    others = [st for axis in view.axes for _, st in axis][:-1]
    if view.base % group or any(st % group for st in others):
        group = 1
    plans = []
    for g in (1, group):
        axes = [[(s, st // g) for s, st in axis] for axis in view.axes]
        if g > 1:
            axes[-1][-1] = (size // g, 1)
        logical = [
            (dim + 1, math.prod(s for s, _ in axis[i + 1 :]))
            for dim, axis in enumerate(axes)
            for i in range(len(axis))
        ]
        sizes = [s for axis in axes for s, _ in axis]
        strides = [st for axis in axes for _, st in axis]
        plans.append(_Plan(view.base // g, sizes, strides, logical))
    return group, plans[0], plans[1]


def _viewable(t: torch.Tensor, group: int) -> bool:
    """Whether `t.view()` as an integer `group` elements wide is allowed (and aligned)."""
    *outer, inner = t.stride()
    fits = inner == 1 and t.size(-1) % group == 0 and t.storage_offset() % group == 0
    return fits and all(stride % group == 0 for stride in outer)


def _views(
    store: torch.Tensor, row: int, view: AffineView, logical: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `row..` of `store` (`[rows, elems]`) and `logical` (`[nb, *offsets' shape]`) as two
    views of one shape, read as wider integers where both sides allow it."""
    group, plan, wide = _plans(view, store.element_size())
    if group > 1 and _viewable(store, group) and _viewable(logical, group):
        kind = _WIDE[group * store.element_size()]
        store, logical, plan = store.view(kind), logical.view(kind), wide
    sizes, at = [logical.shape[0], *plan.sizes], logical.stride()
    blocks = store.as_strided(
        sizes,
        [store.stride(0), *plan.strides],
        store.storage_offset() + row * store.stride(0) + plan.base,
    )
    strides = [at[0], *(at[dim] * inner for dim, inner in plan.logical)]
    return blocks, logical.as_strided(sizes, strides, logical.storage_offset())


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`; where `dst`'s contiguous axis is a few elements (VNNI pairs) and
    `src`'s is another, one copy per index of it, so the inner loop runs along a long axis."""
    strides = dst.stride()
    inner = min(range(dst.dim()), key=lambda i: strides[i] if dst.size(i) > 1 else math.inf)
    if strides[inner] != 1 or src.stride(inner) == 1 or dst.size(inner) > _SPLIT_INNER:
        dst.copy_(src)
        return
    for i in range(dst.size(inner)):
        dst.select(inner, i).copy_(src.select(inner, i))


def _move_blocks(
    cache: torch.Tensor, layout: BlockLayout, run: _Run, logical: torch.Tensor, to_cache: bool
) -> None:
    """Copy whole kernel blocks `run.ids` between `cache` and `logical` (`[nb, 2, N, H, D]`,
    any strides): straight through strided views while the ids are a few consecutive runs,
    else through one staging copy of the rows (`index_select`/`index_copy_`, memcpy speed)."""
    store, parts = layout.blocks_view(cache), layout.affine
    pieces = [logical] if len(parts) == 1 else [logical[:, 0], logical[:, 1]]
    run_bytes = len(run.ids) * layout.elems * cache.element_size() // len(run.pieces)
    by_run = cache.device.type == "cpu" and run_bytes >= _DIRECT_RUN_BYTES
    if (len(run.pieces) == 1 or by_run) and None not in parts:
        for view, piece in zip(parts, pieces, strict=True):
            assert view is not None
            for first, block, count in run.pieces:
                blocks, part = _views(store, block, view, piece[first : first + count])
                _copy(*((blocks, part) if to_cache else (part, blocks)))
        return
    index = torch.tensor(run.ids, dtype=torch.long, device=cache.device)
    keep = not to_cache or layout.elems != logical[0].numel()
    stage = store.index_select(0, index) if keep else store.new_empty((len(run.ids), layout.elems))
    for kv, (view, piece) in enumerate(zip(parts, pieces, strict=True)):
        if view is not None:
            blocks, part = _views(stage, 0, view, piece)
            _copy(*((blocks, part) if to_cache else (part, blocks)))
        elif to_cache:
            stage.index_copy_(1, layout.offsets[kv].flatten(), piece.reshape(len(run.ids), -1))
        else:
            piece.copy_(stage.index_select(1, layout.offsets[kv].flatten()).view(piece.shape))
    if to_cache and cache.device.type == "cpu":  # a memcpy per row (index_copy_ loops)
        store.view(torch.uint8).numpy()[run.ids] = stage.view(torch.uint8).numpy()
    elif to_cache:
        store.index_copy_(0, index, stage)


def to_blocks(layouts: Sequence[BlockLayout], wire: torch.Tensor, out: torch.Tensor) -> bool:
    """LMCache's `KV_2LTD` payload `wire` (`[2, L, T, H, D]`, contiguous, T a whole number
    of kernel blocks; `[1, ...]`: `KV_MLA_FMT`) in the engine's block layout, into `out`
    (`[L, T / N, elems]`, the
    cache dtype): row `[l, i]` is what kernel block `i` of the piece holds in layer `l`.
    Layers that share a layout (all of them, as a rule) move together, so a piece costs a
    copy or two, not one per layer and block. False, `out` unwritten, where a layout is not
    affine (the caller scatters instead)."""
    layers, blocks = out.shape[0], out.shape[1]
    n, heads, dim = layouts[0].tokens, layouts[0].heads, layouts[0].head_dim
    planes = layouts[0].planes
    if tuple(wire.shape) != (planes, layers, blocks * n, heads, dim) or not wire.is_contiguous():
        raise ValueError(f"a KV_2LTD piece of {blocks} blocks, got {tuple(wire.shape)}")
    if any(None in lay.affine for lay in layouts):
        return False
    first = 0
    while first < layers:  # runs of layers with one layout
        end = first + 1
        while end < layers and layouts[end].affine == layouts[first].affine:
            end += 1
        rows = (end - first) * blocks
        # [2, l, T, H, D] -> [l * nb, 2, N, H, D]: one logical block per row of `store`
        logical = wire[:, first:end].reshape(planes, rows, n, heads, dim).transpose(0, 1)
        store = out[first:end].reshape(rows, -1)
        parts = layouts[first].affine
        pieces = [logical] if len(parts) == 1 else [logical[:, 0], logical[:, 1]]
        for view, piece in zip(parts, pieces, strict=True):
            assert view is not None
            _copy(*_views(store, 0, view, piece))
        first = end
    return True


def gather(
    caches: list[torch.Tensor], layouts: list[BlockLayout], slots: TokenSlots
) -> torch.Tensor:
    """K and V of `slots` from every layer as `[2, L, H, T, D]` (on the caches' device; MLA:
    `[1, L, 1, T, latent]`)."""
    first, shape = caches[0], layouts[0]
    out = first.new_empty((shape.planes, len(caches), shape.heads, slots.count, shape.head_dim))
    _move(caches, layouts, slots, out, to_cache=False)
    return out


def scatter(
    caches: list[torch.Tensor], layouts: list[BlockLayout], slots: TokenSlots, kv: torch.Tensor
) -> None:
    """Write `kv` (`[2, L, H, T, D]`) into `slots` of every layer's cache."""
    _move(caches, layouts, slots, kv, to_cache=True)


def _move(
    caches: list[torch.Tensor],
    layouts: list[BlockLayout],
    slots: TokenSlots,
    kv: torch.Tensor,
    to_cache: bool,
) -> None:
    """Between every layer's cache and `kv`: whole blocks by `_move_blocks`, the tokens of
    partly covered blocks through one index per element."""
    by_size = {n: _whole_blocks(slots, n) for n in {layout.tokens for layout in layouts}}
    for layer, (cache, layout) in enumerate(zip(caches, layouts, strict=True)):
        (runs, rest), n = by_size[layout.tokens], layout.tokens
        tokens = kv[:, layer].to(cache.device, cache.dtype) if to_cache else kv[:, layer]
        for run in runs:  # tokens: [2, H, T, D]
            part = tokens[:, :, run.start : run.start + len(run.ids) * n]
            logical = part.unflatten(2, (len(run.ids), n)).permute(2, 0, 3, 1, 4)
            _move_blocks(cache, layout, run, logical, to_cache)
        if rest.numel():
            rows = slots.blocks[rest].to(cache.device).view(1, -1, 1, 1)
            cols = layout.offsets[:, slots.within[rest].to(cache.device)]  # [2, R, H, D]
            at, blocks = rest.to(cache.device), layout.blocks_view(cache)
            if to_cache:
                blocks[rows, cols] = tokens[:, :, at].permute(0, 2, 1, 3)
            else:
                tokens[:, :, at] = blocks[rows, cols].permute(0, 2, 1, 3)
