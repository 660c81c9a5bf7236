"""Paged payloads in the engine's own block layout (BlockCopier), and the fast whole-block
path of `layout.gather`/`scatter`, for every layout test_layout.py learns: the CPU backend's
real write op per ISA and FlashAttention's, written in plain torch. The same checks run on
CUDA where there is a GPU (CPU-learned layouts on device caches; host buffers pinned with
`register_host`, and pageable).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
import torch

from tests.vllm_connector.test_layout import (
    BLOCKS,
    CASES,
    DIM,
    HEADS,
    TOKENS,
    cpu_cache,
    flash_cache,
    flash_writer,
    writer_for,
)
from vllm_connector import blockcopy
from vllm_connector import layout as layout_module
from vllm_connector.blockcopy import (
    BlockCopier,
    _drain_cuda_error,
    kernel_blocks,
    register_host,
    unregister_host,
)
from vllm_connector.layout import (
    AffineView,
    BlockLayout,
    TokenSlots,
    affine_view,
    gather,
    probe_layout,
    scatter,
    token_slots,
)

LAYERS = 3
Make = Callable[[torch.dtype], torch.Tensor]


def reference_gather(
    caches: list[torch.Tensor], layouts: list[BlockLayout], slots: TokenSlots
) -> torch.Tensor:
    """The indexed implementation: one int64 index per element."""
    out = []
    for cache, layout in zip(caches, layouts, strict=True):
        rows = slots.blocks.to(cache.device).view(1, -1, 1, 1)
        cols = layout.offsets[:, slots.within.to(cache.device)]
        out.append(layout.blocks_view(cache)[rows, cols].permute(0, 2, 1, 3))
    return torch.stack(out, dim=1)


def reference_scatter(
    caches: list[torch.Tensor], layouts: list[BlockLayout], slots: TokenSlots, kv: torch.Tensor
) -> None:
    for layer, (cache, layout) in enumerate(zip(caches, layouts, strict=True)):
        rows = slots.blocks.to(cache.device).view(1, -1, 1, 1)
        cols = layout.offsets[:, slots.within.to(cache.device)]
        src = kv[:, layer].permute(0, 2, 1, 3).to(cache.device, cache.dtype)
        layout.blocks_view(cache)[rows, cols] = src


def shuffled_writer(perm: torch.Tensor) -> Callable[..., None]:
    """A layout that is no strided view: every element of a block at a random place."""

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        rows = cache.view(cache.shape[0], -1)
        blocks, within = slots // TOKENS, slots % TOKENS
        inner = torch.arange(HEADS).view(1, -1, 1) * DIM + torch.arange(DIM)
        for kv, vals in ((0, k), (1, v)):
            logical = (kv * TOKENS + within).view(-1, 1, 1) * HEADS * DIM + inner
            rows[blocks.view(-1, 1, 1), perm[logical]] = vals

    return write


def random_caches(make: Make, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    caches = [make(dtype) for _ in range(LAYERS)]
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    return caches


def learned(isa: str, dtype: torch.dtype, make: Make) -> list[BlockLayout]:
    return [probe_layout(make(dtype), writer_for(isa), HEADS, DIM)] * LAYERS


def rows(caches: list[torch.Tensor], layouts: list[BlockLayout], ids: list[int]) -> torch.Tensor:
    """The raw storage of blocks `ids` of every layer, `[L, len(ids), elems]`."""
    return torch.stack([lay.blocks_view(c)[ids] for c, lay in zip(caches, layouts, strict=True)])


SLOTS = {
    "consecutive blocks": lambda: token_slots([2, 3, 4], TOKENS, TOKENS, 0, 3 * TOKENS),
    "scattered blocks, partial ends": lambda: token_slots(
        [5, 3, 1, 4, 0, 2], TOKENS, TOKENS, 50, 6 * TOKENS - 30
    ),
    "kernel blocks inside scheduler blocks": lambda: token_slots([2, 0], 256, TOKENS, 100, 500),
    "less than a block": lambda: token_slots([3], TOKENS, TOKENS, 7, 90),
}


@pytest.fixture(params=["direct", "staged"])
def block_copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways whole blocks of scattered ids move in `gather`/`scatter`: a strided copy per
    run of consecutive ids, and one through a staging copy of the rows."""
    direct = request.param == "direct"
    monkeypatch.setattr(layout_module, "_DIRECT_RUN_BYTES", 0 if direct else 1 << 62)


@pytest.mark.usefixtures("block_copies")
@pytest.mark.parametrize(("isa", "dtype", "make"), CASES)
@pytest.mark.parametrize("slots_of", SLOTS.values(), ids=SLOTS.keys())
def test_fast_gather_and_scatter_equal_the_indexed_ones(
    isa: str, dtype: torch.dtype, make: Make, slots_of: Callable[[], TokenSlots]
) -> None:
    layouts, slots = learned(isa, dtype, make), slots_of()
    caches = random_caches(make, dtype, seed=1)
    assert torch.equal(gather(caches, layouts, slots), reference_gather(caches, layouts, slots))

    kv = torch.randn(2, LAYERS, HEADS, slots.count + 9, DIM)[:, :, :, 4:-5]  # not contiguous
    ours, theirs = random_caches(make, dtype, seed=2), random_caches(make, dtype, seed=2)
    scatter(ours, layouts, slots, kv)
    reference_scatter(theirs, layouts, slots, kv)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize("slots_of", SLOTS.values(), ids=SLOTS.keys())
def test_a_layout_that_is_no_strided_view_still_moves_whole_blocks(
    slots_of: Callable[[], TokenSlots],
) -> None:
    perm = torch.randperm(2 * TOKENS * HEADS * DIM, generator=torch.Generator().manual_seed(3))
    layout = probe_layout(cpu_cache(torch.float32), shuffled_writer(perm), HEADS, DIM)
    assert layout.affine == (None, None)
    layouts, slots = [layout] * LAYERS, slots_of()
    caches = random_caches(cpu_cache, torch.float32, seed=4)
    assert torch.equal(gather(caches, layouts, slots), reference_gather(caches, layouts, slots))
    kv = torch.randn(2, LAYERS, HEADS, slots.count, DIM)
    ours, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    scatter(ours, layouts, slots, kv)
    reference_scatter(theirs, layouts, slots, kv)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def check_round_trip(
    make: Make, dtype: torch.dtype, layouts: list[BlockLayout], device: str, pin: bool
) -> None:
    """read() of blocks [4, 1] then write() into blocks [2, 5] of empty caches copies the
    blocks' storage exactly and touches nothing else."""
    source = [c.to(device) for c in random_caches(make, dtype, seed=5)]
    copier = BlockCopier(source, layouts)
    out = torch.zeros(copier.nbytes(2 * TOKENS - 5) + 64, dtype=torch.uint8)  # spare bytes
    fresh = [make(dtype).to(device) for _ in range(LAYERS)]
    target = BlockCopier(fresh, layouts)
    assert not pin or register_host(out)
    try:
        copier.read([4, 1], out)
        copier.wait()
        target.write([2, 5], out, 0, 2 * TOKENS)
        target.wait()
    finally:
        assert not pin or unregister_host(out)
    assert torch.equal(rows(fresh, layouts, [2, 5]), rows(source, layouts, [4, 1]))
    assert not rows(fresh, layouts, [0, 1, 3, 4]).any()


def check_partial_writes(
    make: Make, dtype: torch.dtype, layouts: list[BlockLayout], device: str, pin: bool
) -> None:
    """write() of tokens [lo, hi) of a 3-block piece changes exactly those tokens."""
    source = [c.to(device) for c in random_caches(make, dtype, seed=6)]
    reader = BlockCopier(source, layouts)
    payload = torch.empty(reader.nbytes(3 * TOKENS), dtype=torch.uint8)
    reader.read([0, 3, 5], payload)
    reader.wait()
    assert not pin or register_host(payload)
    try:
        for lo, hi in [(5, 2 * TOKENS + 7), (TOKENS + 3, TOKENS + 50), (0, TOKENS), (64, 384)]:
            caches = [c.to(device) for c in random_caches(make, dtype, seed=7)]
            before = [c.clone() for c in caches]
            copier = BlockCopier(caches, layouts)
            copier.write([1, 4, 2], payload, lo, hi)
            copier.wait()
            piece = token_slots([1, 4, 2], TOKENS, TOKENS, 0, 3 * TOKENS)
            got, old = gather(caches, layouts, piece), gather(before, layouts, piece)
            new = gather(source, layouts, token_slots([0, 3, 5], TOKENS, TOKENS, 0, 3 * TOKENS))
            assert torch.equal(got[:, :, :, lo:hi], new.to(device)[:, :, :, lo:hi])
            assert torch.equal(got[:, :, :, :lo], old[:, :, :, :lo])
            assert torch.equal(got[:, :, :, hi:], old[:, :, :, hi:])
            untouched = [0, 3, 5]
            assert torch.equal(rows(caches, layouts, untouched), rows(before, layouts, untouched))
    finally:
        assert not pin or unregister_host(payload)


def check_batched(
    make: Make, dtype: torch.dtype, layouts: list[BlockLayout], device: str, pin: bool
) -> None:
    """read_many() then write_many() (a partial last piece) equal read() and write() one
    piece at a time: on CUDA they take another road (one index kernel per layer for all)."""
    source = [c.to(device) for c in random_caches(make, dtype, seed=9)]
    reader = BlockCopier(source, layouts)
    pieces = [([0, 3], 0, 2 * TOKENS), ([5], 0, TOKENS), ([1, 4], 0, TOKENS + 9)]
    outs = [torch.zeros(reader.nbytes(2 * TOKENS), dtype=torch.uint8) for _ in pieces]
    for out in outs:
        assert not pin or register_host(out)
    try:
        reader.read_many([(ids, out) for (ids, _, _), out in zip(pieces, outs, strict=True)])
        reader.wait()
        one, many = ([make(dtype).to(device) for _ in range(LAYERS)] for _ in range(2))
        dst = [[2, 1], [4], [0, 5]]
        single = BlockCopier(one, layouts)
        for ids, out, (_, lo, hi) in zip(dst, outs, pieces, strict=True):
            single.write(ids, out, lo, hi)
        single.wait()
        batched = BlockCopier(many, layouts)
        batched.write_many(
            [(ids, out, lo, hi) for ids, out, (_, lo, hi) in zip(dst, outs, pieces, strict=True)]
        )
        batched.wait()
    finally:
        for out in outs:
            assert not pin or unregister_host(out)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))
    want = gather(source, layouts, token_slots([0, 3, 5, 1, 4], TOKENS, TOKENS, 0, 4 * TOKENS + 9))
    got = gather(many, layouts, token_slots([2, 1, 4, 0, 5], TOKENS, TOKENS, 0, 4 * TOKENS + 9))
    assert torch.equal(got, want.to(device))


@pytest.mark.parametrize(("isa", "dtype", "make"), CASES)
def test_batched_reads_and_writes_equal_one_piece_at_a_time(
    isa: str, dtype: torch.dtype, make: Make
) -> None:
    check_batched(make, dtype, learned(isa, dtype, make), "cpu", False)


@pytest.mark.parametrize(("isa", "dtype", "make"), CASES)
def test_read_then_write_reproduces_the_blocks(isa: str, dtype: torch.dtype, make: Make) -> None:
    check_round_trip(make, dtype, learned(isa, dtype, make), "cpu", pin=False)


@pytest.mark.parametrize(("isa", "dtype", "make"), CASES)
def test_a_partial_write_changes_only_its_tokens(isa: str, dtype: torch.dtype, make: Make) -> None:
    check_partial_writes(make, dtype, learned(isa, dtype, make), "cpu", pin=False)


def test_the_amx_layout_is_read_as_strided_factors() -> None:
    """vLLM's `amx` cache (this CPU's for bf16): K packs channel pairs of 16-token tiles,
    V packs token pairs of 16-channel tiles; both move as strided views."""
    layout = learned("amx", torch.bfloat16, cpu_cache)[0]
    k, v = layout.affine
    head = 2 * TOKENS * DIM
    tile = 16 * DIM
    assert k == AffineView(
        0, (((TOKENS // 16, tile), (16, 2)), ((HEADS, head),), ((DIM // 2, 32), (2, 1)))
    )
    assert v == AffineView(
        TOKENS * DIM,
        (((TOKENS // 2, 32), (2, 1)), ((HEADS, head),), ((DIM // 16, 16 * TOKENS), (16, 2))),
    )


def test_offsets_that_look_affine_along_each_axis_but_are_not() -> None:
    n, h, d = torch.meshgrid(torch.arange(4), torch.arange(3), torch.arange(5), indexing="ij")
    assert affine_view(n * 15 + h * 5 + d) == AffineView(0, (((4, 15),), ((3, 5),), ((5, 1),)))
    assert affine_view(n * 15 + (h + n) % 3 * 5 + d) is None  # each line from 0 is affine


def test_the_tag_names_the_payload_format() -> None:
    """Equal tags exactly for equal dtype, layer count and block layout."""
    formats: dict[int, tuple[torch.dtype, int, bytes]] = {}
    amx = torch.cpu._is_amx_tile_supported()
    for isa, dtype, make in [c for c in CASES if amx or c[0] != "amx"]:
        layout = learned(isa, dtype, make)[0]
        for layers in (LAYERS, LAYERS + 1):
            for _ in range(2):  # a second engine, learning the same layout again
                tag = BlockCopier([make(dtype)] * layers, [layout] * layers).tag
                assert 0 < tag < 2**31
                key = (dtype, layers, layout.offsets.numpy().tobytes())
                assert formats.setdefault(tag, key) == key
    keys = list(formats.values())
    assert len(set(keys)) == len(keys)


def test_payload_sizes_and_bad_buffers() -> None:
    caches = [flash_cache(torch.float16) for _ in range(LAYERS)]
    copier = BlockCopier(caches, learned("flash", torch.float16, flash_cache))
    assert copier.block_bytes == LAYERS * 2 * TOKENS * HEADS * DIM * 2
    assert copier.nbytes(1) == copier.block_bytes
    assert copier.nbytes(TOKENS) == copier.block_bytes
    assert copier.nbytes(TOKENS + 1) == 2 * copier.block_bytes
    with pytest.raises(ValueError, match="need"):
        copier.read([0, 1], torch.empty(copier.block_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        copier.read([0], torch.empty(copier.block_bytes // 2, dtype=torch.float16))
    with pytest.raises(ValueError, match="inside"):
        copier.write([0], torch.empty(copier.block_bytes, dtype=torch.uint8), 0, TOKENS + 1)
    # a block id outside the cache is refused before any byte moves (a memmove has no bounds)
    blocks = caches[0].shape[0]
    payload = torch.zeros(copier.block_bytes, dtype=torch.uint8)
    for bad in (blocks, -1):
        before = [c.clone() for c in caches]
        with pytest.raises(ValueError, match="not in a cache"):
            copier.write([bad], payload, 0, TOKENS)
        with pytest.raises(ValueError, match="not in a cache"):
            copier.read([bad], payload)
        assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))


def test_kernel_blocks_follow_token_slots() -> None:
    assert kernel_blocks([7, 2], 256, TOKENS, 0, 400) == [14, 15, 4, 5]
    assert kernel_blocks([7, 2], 256, TOKENS, TOKENS, 300) == [15, 4]
    slots = token_slots([7, 2], 256, TOKENS, 0, 400)
    assert kernel_blocks([7, 2], 256, TOKENS, 0, 400) == slots.blocks[::TOKENS].tolist()
    with pytest.raises(ValueError):
        kernel_blocks([7, 2], 256, TOKENS, 5, 300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_host_memory_is_not_registered() -> None:
    buf = torch.empty(4096, dtype=torch.uint8)
    assert register_host(buf) is False
    assert unregister_host(buf) is False


class TestOnCuda:
    """The same checks with the caches on a GPU (copies on the copier's side stream)."""

    @pytest.fixture(autouse=True)
    def _cuda(self) -> None:
        if not torch.cuda.is_available():
            pytest.skip("no CUDA")

    @staticmethod
    def on_cuda(layouts: list[BlockLayout]) -> list[BlockLayout]:
        return [dataclasses.replace(lay, offsets=lay.offsets.cuda()) for lay in layouts]

    @pytest.mark.parametrize("pin", [True, False], ids=["registered", "pageable"])
    @pytest.mark.parametrize(("isa", "dtype", "make"), CASES)
    def test_read_write(self, isa: str, dtype: torch.dtype, make: Make, pin: bool) -> None:
        layouts = self.on_cuda(learned(isa, dtype, make))
        check_round_trip(make, dtype, layouts, "cuda", pin)
        check_partial_writes(make, dtype, layouts, "cuda", pin)
        check_batched(make, dtype, layouts, "cuda", pin)

    @pytest.mark.parametrize(("isa", "dtype", "make"), CASES)
    def test_gather_and_scatter(self, isa: str, dtype: torch.dtype, make: Make) -> None:
        layouts = self.on_cuda(learned(isa, dtype, make))
        caches = [c.cuda() for c in random_caches(make, dtype, seed=8)]
        copier = BlockCopier(caches, layouts)
        for slots_of in SLOTS.values():
            slots = slots_of()
            want = reference_gather(caches, layouts, slots)
            assert torch.equal(copier.gather_2ltd(slots), want)
            kv = torch.randn(2, LAYERS, HEADS, slots.count, DIM, device="cuda")
            theirs = [c.clone() for c in caches]
            copier.scatter_2ltd(slots, kv)
            reference_scatter(theirs, layouts, slots, kv)
            assert all(torch.equal(a, b) for a, b in zip(caches, theirs, strict=True))

    def test_the_flash_writer_runs_on_the_device(self) -> None:
        """A layout learned on the GPU itself equals the one learned on the CPU."""
        on_gpu = probe_layout(flash_cache(torch.bfloat16).cuda(), flash_writer, HEADS, DIM)
        on_cpu = probe_layout(flash_cache(torch.bfloat16), flash_writer, HEADS, DIM)
        assert torch.equal(on_gpu.offsets.cpu(), on_cpu.offsets)

    def test_registration_is_idempotent(self) -> None:
        buf = torch.empty(1 << 20, dtype=torch.uint8)
        assert register_host(buf) and buf.is_pinned()
        assert register_host(buf)  # already pinned: left as it is
        assert unregister_host(buf) and not buf.is_pinned()
        assert not unregister_host(buf)

    def test_a_refused_registration_leaves_no_error_behind(self) -> None:
        buf = torch.empty(1 << 20, dtype=torch.uint8)
        assert register_host(buf)
        try:
            cudart = torch.cuda.cudart()
            assert int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)) != 0  # twice
            _drain_cuda_error()
            torch.ones(4, device="cuda").add_(1)  # its launch check would raise a leftover
            torch.cuda.synchronize()
        finally:
            assert unregister_host(buf)

    @pytest.mark.parametrize("kernel", ["auto", "torch"])
    def test_the_ring_equals_the_host_path(self, kernel: str) -> None:
        """Writes with partial ends and reads through slots of two blocks (pieces split
        between fills) leave the device caches byte for byte as the CPU host path does."""
        layouts = learned("flash", torch.float16, flash_cache)
        host_caches = random_caches(flash_cache, torch.float16, seed=31)
        dev_caches = [c.cuda() for c in host_caches]
        host = BlockCopier(host_caches, layouts)
        ring = BlockCopier(
            dev_caches, self.on_cuda(layouts), kernel=kernel, slot_bytes=2 * host.block_bytes
        )
        gen = torch.Generator().manual_seed(32)
        srcs = [torch.randint(0, 256, (host.nbytes(3 * TOKENS),), generator=gen).to(torch.uint8)]
        srcs.append(srcs[0][: host.nbytes(2 * TOKENS)].clone())
        items = [([4, 1, 3], srcs[0], 5, 3 * TOKENS - 7), ([0, 5], srcs[1], 0, 2 * TOKENS)]
        host.write_many(items)
        ring.write_many(items).wait()
        for a, b in zip(host_caches, dev_caches, strict=True):
            assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8))
        outs = [torch.zeros(host.nbytes(BLOCKS * TOKENS), dtype=torch.uint8) for _ in range(2)]
        order = random.Random(33).sample(range(BLOCKS), BLOCKS)
        host.read_many([(order, outs[0])])
        handle = ring.read_many([(order, outs[1])])
        handle.wait()
        assert handle.done() and isinstance(handle.event, torch.cuda.Event)
        assert torch.equal(outs[0], outs[1])

    @pytest.mark.parametrize("kernel", ["auto", "torch"])
    def test_a_load_waits_for_the_event_it_is_given(self, kernel: str) -> None:
        """A kernel on another stream writes the destination blocks after a long spin; the
        load, ordered after it by `after`, must win: the blocks hold the load's bytes. (A
        load ordered only after the calling thread's stream would run during the spin and
        be overwritten.) A read ordered the same way sees that kernel's values."""
        layouts = self.on_cuda(learned("flash", torch.bfloat16, flash_cache))
        caches = [flash_cache(torch.bfloat16).cuda() for _ in range(LAYERS)]
        copier = BlockCopier(caches, layouts, kernel=kernel)
        src = torch.randint(0, 256, (copier.nbytes(2 * TOKENS),), dtype=torch.uint8)
        src = src.pin_memory()
        warm = torch.zeros_like(src).pin_memory()  # first calls allocate their index buffers
        copier.write_many([([1, 4], src, 0, 2 * TOKENS)]).wait()
        copier.read_many([([1, 4], warm)]).wait()
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning before the writes
            for cache in caches:
                cache.fill_(7)
            written = torch.cuda.Event()
            written.record(other)
        handle = copier.write_many([([1, 4], src, 0, 2 * TOKENS)], after=written)
        assert not handle.done()  # still behind the spin: the host was not blocked
        handle.wait()
        got = torch.stack(
            [lay.blocks_view(c)[[1, 4]] for c, lay in zip(caches, layouts, strict=True)]
        )
        want = src.view(torch.bfloat16).view(LAYERS, 2, -1).cuda()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))

        with torch.cuda.stream(other):
            torch.cuda._sleep(200_000_000)
            for cache in caches:
                cache.fill_(3)
            written = torch.cuda.Event()
            written.record(other)
        out = torch.zeros(copier.nbytes(2 * TOKENS), dtype=torch.uint8).pin_memory()
        copier.read_many([([1, 4], out)], after=written).wait()
        assert bool((out.view(torch.bfloat16) == 3).all())

    @pytest.mark.parametrize("kernel", ["auto", "torch"])
    def test_a_read_gathers_with_its_own_block_indices(self, kernel: str) -> None:
        """A call's block indices go up on the DMA stream; a read's gathers run on the other
        stream and wait for no DMA of their own, so they must wait for that upload. With
        the DMA stream held back by a spin, a read right after a read of other blocks
        gathering too early would use the earlier read's indices (still in the buffer)."""
        layouts = self.on_cuda(learned("flash", torch.bfloat16, flash_cache))
        caches = [c.cuda() for c in random_caches(flash_cache, torch.bfloat16, seed=36)]
        copier = BlockCopier(caches, layouts, kernel=kernel)
        assert copier.ring is not None and copier.ring._dma is not None
        first, second = (
            torch.zeros(copier.nbytes(2 * TOKENS), dtype=torch.uint8).pin_memory() for _ in range(2)
        )
        copier.read_many([([1, 4], first)]).wait()
        with torch.cuda.stream(copier.ring._dma):
            torch.cuda._sleep(200_000_000)  # ~0.1 s before this read's indices go up
        copier.read_many([([2, 5], second)]).wait()
        for out, ids in ((first, [1, 4]), (second, [2, 5])):
            want = rows(caches, layouts, ids).cpu().contiguous().view(torch.uint8).flatten()
            assert torch.equal(out, want), f"blocks {ids}"

    def test_the_triton_kernel_is_chosen_where_torch_ships_triton(self) -> None:
        """ "auto" is Triton where it imports: a fallback here means the kernel failed its
        start-up check against torch's copy (logged), not that it is absent."""
        pytest.importorskip("triton")
        layouts = self.on_cuda(learned("flash", torch.bfloat16, flash_cache))
        copier = BlockCopier([flash_cache(torch.bfloat16).cuda() for _ in range(LAYERS)], layouts)
        assert copier.ring is not None and copier.ring.kernel == "triton"

    def test_loads_and_stores_compile_no_triton_kernel(self) -> None:
        """The start-up check compiles both directions; calls whose block indices sit at
        other alignments in the index buffer (odd and even piece counts, fills at odd
        offsets) reuse them: nothing is compiled during a load or a store."""
        pytest.importorskip("triton")
        from vllm_connector.ring_kernel import _move_rows_kernel

        layouts = self.on_cuda(learned("flash", torch.bfloat16, flash_cache))
        caches = [c.cuda() for c in random_caches(flash_cache, torch.bfloat16, seed=37)]
        copier = BlockCopier(caches, layouts, slot_bytes=3 * LAYERS * caches[0][0].nbytes)
        assert copier.ring is not None and copier.ring.kernel == "triton"
        caches_of = getattr(_move_rows_kernel(), "device_caches", None)
        if caches_of is None:
            pytest.skip("this Triton keeps its compiled kernels elsewhere")
        compiled = caches_of[torch.cuda.current_device()][0]
        before = len(compiled)
        src = torch.randint(0, 256, (copier.nbytes(5 * TOKENS),), dtype=torch.uint8)
        for ids in ([1], [2, 5], [0, 3, 4], [5, 1, 2, 0, 4], [4, 0, 1, 2, 3]):
            copier.write_many([(ids, src, 0, len(ids) * TOKENS)]).wait()
            out = torch.zeros(copier.nbytes(len(ids) * TOKENS), dtype=torch.uint8)
            copier.read_many([(ids, out)]).wait()
            assert torch.equal(out, src[: out.numel()])
        assert len(compiled) == before, "a load or store compiled a Triton kernel"

    @pytest.mark.parametrize("kernel", ["auto", "torch"])
    def test_a_32k_token_load_takes_no_more_device_memory_than_the_ring(self, kernel: str) -> None:
        """A 32k-token history (4 layers of Llama-3-8B's heads, 16-token blocks: 512 MiB)
        loads with device memory beyond the caches bounded by the ring and its indices,
        not by the load's size (the old copier staged all of it, then `torch.cat`)."""
        from benchmarks.kvpath import kvpath

        shape, n, tokens, layers = kvpath.Shape("8b-ish", 4, 8, 128, 32768), 16, 32768, 4
        blocks = tokens // n + 8
        layout = probe_layout(
            kvpath.flash_cache(1, n, shape, torch.bfloat16, torch.device("cpu")),
            kvpath.flash_writer(n, shape.head_dim),
            shape.kv_heads,
            shape.head_dim,
        )
        layout = dataclasses.replace(layout, offsets=layout.offsets.cuda())
        caches = [
            kvpath.flash_cache(blocks, n, shape, torch.bfloat16, torch.device("cuda"))
            for _ in range(layers)
        ]
        copier = BlockCopier(caches, [layout] * layers, kernel=kernel)
        ids = random.Random(34).sample(range(blocks), tokens // n)
        piece = 256 // n  # the connector's 256-token chunks
        payload = torch.randint(0, 256, (copier.nbytes(tokens),), dtype=torch.uint8)
        payload = payload.pin_memory()
        items = []
        for k in range(0, len(ids), piece):
            nbytes = copier.nbytes(piece * n)
            src = payload[k * copier.block_bytes : k * copier.block_bytes + nbytes]
            items.append((ids[k : k + piece], src, 0, piece * n))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        copier.write_many(items).wait()
        peak = torch.cuda.max_memory_allocated() - before
        ring = copier.device_bytes
        assert ring <= 2 * (32 << 20) + (1 << 20)
        # the torch fallback stages one layer's rows of a fill (index_select) on top
        assert copier.ring is not None
        allowed = (1 << 20) + (ring if copier.ring.kernel == "torch" else 0)
        assert peak <= allowed, f"a {tokens}-token load took {peak} bytes beyond the caches"
        # and it loaded: the first and the last piece, every layer
        for k in (0, len(items) - 1):
            block_ids, src, _, _ = items[k]
            got = torch.stack([layout.blocks_view(c)[block_ids] for c in caches])
            want = src.view(torch.bfloat16).view(layers, len(block_ids), -1)
            assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


def test_random_block_order_round_trips() -> None:
    """Any order of block ids, read and written back, restores the cache."""
    make = flash_cache
    layouts = learned("flash", torch.bfloat16, make)
    caches = random_caches(make, torch.bfloat16, seed=9)
    before = [c.clone() for c in caches]
    copier = BlockCopier(caches, layouts)
    ids = random.Random(0).sample(range(BLOCKS), BLOCKS)
    payload = torch.empty(copier.nbytes(BLOCKS * TOKENS), dtype=torch.uint8)
    copier.read(ids, payload)
    for cache in caches:
        cache.zero_()
    copier.write(ids, payload, 0, BLOCKS * TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))


def wire_piece(blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A KV_2LTD piece as it comes off the wire (`[2, L, T, H, D]`, contiguous), viewed as
    the connector holds it: `[2, L, H, T, D]`."""
    gen = torch.Generator().manual_seed(seed)
    wire = torch.randn(2, LAYERS, blocks * TOKENS, HEADS, DIM, generator=gen).to(dtype)
    return wire.transpose(2, 3)


@pytest.mark.parametrize(("isa", "dtype", "make"), CASES)
@pytest.mark.parametrize("lo_hi", [(0, 3 * TOKENS), (5, 2 * TOKENS + 7), (TOKENS, 2 * TOKENS)])
def test_a_kv_2ltd_piece_written_as_blocks_equals_the_indexed_scatter(
    isa: str, dtype: torch.dtype, make: Make, lo_hi: tuple[int, int]
) -> None:
    """The TCP path's write: the wire's piece put into the engine's block layout, every
    layer in one or two copies (`to_blocks`), then rows; equal to the element-wise
    scatter, and nothing outside tokens [lo, hi) changes."""
    lo, hi = lo_hi
    layouts, kv = learned(isa, dtype, make), wire_piece(3, dtype, seed=11)
    ours, theirs = random_caches(make, dtype, seed=12), random_caches(make, dtype, seed=12)
    ids = [4, 0, 2]
    assert BlockCopier(ours, layouts).write_2ltd(ids, kv, lo, hi)
    reference_scatter(theirs, layouts, token_slots(ids, TOKENS, TOKENS, lo, hi), kv[..., lo:hi, :])
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_layers_with_two_layouts_move_in_two_runs() -> None:
    """Layers whose layouts differ (here amx-packed and plain `vec`, same block size) each
    get their own; a layout that is no strided view is refused, nothing written."""
    dtype = torch.bfloat16
    amx, vec = learned("amx", dtype, cpu_cache)[0], learned("vec", dtype, cpu_cache)[0]
    assert amx.affine != vec.affine and amx.elems == vec.elems
    layouts = [amx, vec, vec]
    kv = wire_piece(2, dtype, seed=13)
    ours, theirs = random_caches(cpu_cache, dtype, 14), random_caches(cpu_cache, dtype, 14)
    assert BlockCopier(ours, layouts).write_2ltd([3, 1], kv, 0, 2 * TOKENS)
    reference_scatter(theirs, layouts, token_slots([3, 1], TOKENS, TOKENS, 0, 2 * TOKENS), kv)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))

    perm = torch.randperm(2 * TOKENS * HEADS * DIM, generator=torch.Generator().manual_seed(3))
    shuffled = probe_layout(cpu_cache(dtype), shuffled_writer(perm), HEADS, DIM)
    caches = random_caches(cpu_cache, dtype, 15)
    before = [c.clone() for c in caches]
    assert not BlockCopier(caches, [shuffled] * LAYERS).write_2ltd([3, 1], kv, 0, 2 * TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(caches, before, strict=True))
    # nor a piece that ends inside a block: the caller scatters it
    assert not BlockCopier(caches, layouts).write_2ltd([3, 1], kv[..., :200, :], 0, 200)


class FakeCudart:
    """torch.cuda.cudart()'s registration calls, recorded; register call `fail_at` fails."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", ptr, nbytes))
        if sum(c[0] == "register" for c in self.calls) - 1 == self.fail_at:
            return 1  # cudaErrorInvalidValue
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        return 0 if self.registered.pop(ptr, None) is not None else 1


@pytest.fixture
def fake_cudart(monkeypatch: pytest.MonkeyPatch) -> Callable[[int | None], FakeCudart]:
    """A machine with CUDA as far as registration can tell, chunks of 4 KiB."""
    monkeypatch.setattr(blockcopy, "REGISTER_CHUNK_BYTES", 4096)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def make(fail_at: int | None) -> FakeCudart:
        fake = FakeCudart(fail_at)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: bool(fake.registered))
        return fake

    return make


def test_a_large_region_is_registered_in_chunks(
    fake_cudart: Callable[[int | None], FakeCudart],
) -> None:
    fake = fake_cudart(None)
    buf = torch.empty(10_000, dtype=torch.uint8)
    base = buf.data_ptr()
    assert register_host(buf)
    assert fake.registered == {base: 4096, base + 4096: 4096, base + 8192: 10_000 - 8192}
    assert unregister_host(buf)
    assert fake.registered == {} and [c[0] for c in fake.calls].count("unregister") == 3


def test_a_refused_chunk_undoes_the_chunks_before_it(
    fake_cudart: Callable[[int | None], FakeCudart],
) -> None:
    fake = fake_cudart(2)
    buf = torch.empty(16_384, dtype=torch.uint8)
    base = buf.data_ptr()
    assert not register_host(buf)
    assert fake.registered == {}  # nothing left pinned
    assert [(c[0], c[1] - base) for c in fake.calls] == [
        ("register", 0),
        ("register", 4096),
        ("register", 8192),
        ("unregister", 0),
        ("unregister", 4096),
    ]
    assert not unregister_host(buf)  # not registered: nothing to undo


def test_copies_on_cpu_are_done_on_return() -> None:
    """The handles of CPU copies: done, no event; the copier holds no device memory."""
    layouts = learned("flash", torch.float16, flash_cache)
    copier = BlockCopier(random_caches(flash_cache, torch.float16, seed=35), layouts)
    out = torch.zeros(copier.nbytes(TOKENS), dtype=torch.uint8)
    handle = copier.read_many([([2], out)], after=None)
    assert handle.done() and handle.event is None and out.any()
    handle.wait()
    assert copier.device_bytes == 0
