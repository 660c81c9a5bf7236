"""The bounded copy engine (`vllm_connector.ring`): the planner on its own, then the
executor on CPU (the same code as on CUDA, minus streams and events) against the copier's
host path byte for byte, for every layout test_layout.py learns; the Triton kernel
(`vllm_connector.ring_kernel`) and its start-up check under Triton's interpreter, in a
subprocess (the interpreter must be chosen before triton is imported)."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.vllm_connector.test_blockcopy import LAYERS, learned, random_caches, shuffled_writer
from tests.vllm_connector.test_layout import BLOCKS, CASES, DIM, HEADS, TOKENS, cpu_cache
from vllm_connector.blockcopy import BlockCopier
from vllm_connector.layout import BlockLayout, probe_layout
from vllm_connector.ring import Fill, Piece, plan
from vllm_connector.ring_kernel import word_size

Make = Callable[[torch.dtype], torch.Tensor]
ROOT = Path(__file__).resolve().parents[2]  # the repository (the GPU check has no yaml)
ROW = 100  # bytes per row in the planner's tests


def simulate(
    fills: list[Fill], pieces: list[Piece], layers: int, tokens: int
) -> dict[tuple[int, int], list[tuple[int, int, int, int, int]]]:
    """Where each host payload row lands: per (layer, cache block), the
    `(item, layer, payload block, lo, hi)` of the host rows moved into it, in order, by
    following each fill's DMA spans into slot rows and its entries out of them."""
    got: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}
    for fill in fills:
        slot: dict[int, tuple[int, int, int]] = {}
        taken = set()
        for span in fill.spans:
            assert span.slot % ROW == 0 and span.host % ROW == 0 and span.nbytes % ROW == 0
            for r in range(span.nbytes // ROW):
                row = span.slot // ROW + r
                assert row not in taken, "two spans fill one slot row"
                taken.add(row)
                host_row = (span.host - pieces[span.item].offset) // ROW + r
                nb = len(pieces[span.item].block_ids)
                slot[row] = (span.item, host_row // nb, host_row % nb)
        assert max(taken) < fill.rows
        for e in (*fill.whole, *fill.edges):
            for layer in range(layers):
                item, lay, i = slot[e.row + layer * e.step]
                assert lay == layer and pieces[item].block_ids[i] == e.block
                got.setdefault((layer, e.block), []).append((item, lay, i, e.lo, e.hi))
        assert all(e.lo == 0 and e.hi == tokens for e in fill.whole)
        assert all((e.lo, e.hi) != (0, tokens) for e in fill.edges)
    return got


def expected(
    pieces: list[Piece], layers: int, tokens: int
) -> dict[tuple[int, int], list[tuple[int, int, int, int, int]]]:
    want: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = {}
    for piece in pieces:
        for i in range(piece.lo // tokens, -(-piece.hi // tokens)):
            if piece.lo == piece.hi:
                break
            lo, hi = max(piece.lo - i * tokens, 0), min(piece.hi - i * tokens, tokens)
            for layer in range(layers):
                want.setdefault((layer, piece.block_ids[i]), []).append(
                    (piece.item, layer, i, lo, hi)
                )
    return want


def plan_of(pieces: list[Piece], layers: int, slot_rows: int, tokens: int = 16) -> list[Fill]:
    return plan(
        pieces,
        tokens=tokens,
        layers=layers,
        row_bytes=ROW,
        slot_bytes=slot_rows * ROW + 7,
        blocks=64,
    )


def test_a_piece_that_fits_is_one_dma_and_one_scatter() -> None:
    pieces = [Piece([5, 2, 9], 0, 48, item=0, offset=300)]
    [fill] = plan_of(pieces, layers=4, slot_rows=12)
    assert [(s.item, s.host, s.slot, s.nbytes) for s in fill.spans] == [(0, 300, 0, 12 * ROW)]
    assert [(e.row, e.step, e.block) for e in fill.whole] == [(0, 3, 5), (1, 3, 2), (2, 3, 9)]
    assert not fill.edges and fill.rows == 12


def test_a_piece_larger_than_a_slot_is_split_between_blocks() -> None:
    """5 blocks of 3 layers in slots of 7 rows (2 blocks each): three fills, each a DMA per
    layer of a run of blocks, every payload row in exactly one place."""
    pieces = [Piece([10, 11, 12, 13, 14], 0, 80, item=0)]
    fills = plan_of(pieces, layers=3, slot_rows=7)
    assert [len(f.whole) for f in fills] == [2, 2, 1]
    assert [len(f.spans) for f in fills] == [3, 3, 3]
    assert [(s.host, s.slot, s.nbytes) for s in fills[1].spans] == [
        (2 * ROW, 0, 2 * ROW),
        (7 * ROW, 2 * ROW, 2 * ROW),
        (12 * ROW, 4 * ROW, 2 * ROW),
    ]
    assert simulate(fills, pieces, 3, 16) == expected(pieces, 3, 16)


def test_a_piece_that_fits_a_slot_is_never_split() -> None:
    """Pieces of 3 blocks x 2 layers in slots of 8 rows: the second does not fit beside the
    first, so it starts the next fill whole (one DMA), rather than being cut in two (a DMA
    per layer for each part)."""
    pieces = [Piece([1, 2, 3], 0, 48, item=0), Piece([4, 5, 6], 0, 48, item=1)]
    fills = plan_of(pieces, layers=2, slot_rows=8)
    assert [[(s.item, s.host, s.slot, s.nbytes) for s in f.spans] for f in fills] == [
        [(0, 0, 0, 6 * ROW)],
        [(1, 0, 0, 6 * ROW)],
    ]
    assert simulate(fills, pieces, 2, 16) == expected(pieces, 2, 16)


def test_partial_first_and_last_blocks_are_edges_with_their_tokens() -> None:
    pieces = [Piece([3, 4, 5, 6], 5, 50, item=0), Piece([7, -1], 0, 9, item=1)]
    fills = plan_of(pieces, layers=2, slot_rows=64)
    edges = [(e.block, e.lo, e.hi) for f in fills for e in f.edges]
    assert edges == [(3, 5, 16), (6, 0, 2), (7, 0, 9)]  # -1 past `hi` is never touched
    assert [e.block for f in fills for e in f.whole] == [4, 5]
    assert simulate(fills, pieces, 2, 16) == expected(pieces, 2, 16)


def test_random_pieces_land_exactly_where_they_belong() -> None:
    """Random block orders, token ranges, payload offsets and slot sizes (a load's blocks
    are distinct, as vLLM allocates them)."""
    rng = random.Random(7)
    for _ in range(300):
        layers, tokens = rng.randint(1, 5), rng.choice([1, 4, 16])
        pieces, free = [], rng.sample(range(64), 64)
        for item in range(rng.randint(1, 5)):
            nb = rng.randint(1, 9)
            lo = rng.randint(0, nb * tokens)
            hi = rng.randint(lo, nb * tokens)
            ids, free = free[:nb], free[nb:]
            pieces.append(Piece(ids, lo, hi, item, offset=ROW * rng.randint(0, 3)))
        slot_rows = rng.randint(layers, 4 * layers * 9)
        fills = plan_of(pieces, layers, slot_rows, tokens)
        assert all(f.rows <= slot_rows for f in fills)
        for piece in pieces:  # split (in more than one fill) only when larger than a slot
            touched = -(-piece.hi // tokens) - piece.lo // tokens if piece.hi > piece.lo else 0
            parts = sum(any(s.item == piece.item for s in f.spans) for f in fills)
            assert parts == (touched > 0) or touched * layers > slot_rows
        assert simulate(fills, pieces, layers, tokens) == expected(pieces, layers, tokens)


def test_what_the_planner_refuses() -> None:
    with pytest.raises(ValueError, match="holds no block"):
        plan_of([Piece([1], 0, 16, 0)], layers=4, slot_rows=3)
    with pytest.raises(ValueError, match="not inside"):
        plan_of([Piece([1], 0, 17, 0)], layers=1, slot_rows=3)
    with pytest.raises(ValueError, match="not in a cache"):
        plan_of([Piece([1, 64], 0, 32, 0)], layers=1, slot_rows=3)
    assert plan_of([Piece([1], 5, 5, 0)], layers=1, slot_rows=3) == []


def test_the_word_is_the_widest_common_divisor() -> None:
    assert word_size(64, 128, 4096) == 8
    assert word_size(64, 12) == 4
    assert word_size(64, 6) == 2
    assert word_size(63) == 1


# -- the executor on CPU against the host path -----------------------------------------
def shuffled_layouts() -> list[BlockLayout]:
    perm = torch.randperm(2 * TOKENS * HEADS * DIM, generator=torch.Generator().manual_seed(3))
    return [probe_layout(cpu_cache(torch.float32), shuffled_writer(perm), HEADS, DIM)] * LAYERS


LAYOUTS = [
    *[(f"{isa}-{str(dtype)[6:]}", dtype, make, None) for isa, dtype, make in CASES],
    ("shuffled-float32", torch.float32, cpu_cache, shuffled_layouts),
]
# payload blocks of each piece -> cache blocks; tokens [lo, hi) of it
WRITES = [
    ([4, 1, 3], 5, 3 * TOKENS - 7),
    ([0], 0, TOKENS),
    ([5, 2], TOKENS + 3, 2 * TOKENS),
]


def layouts_of(name: str, dtype: torch.dtype, make: Make, custom: object) -> list[BlockLayout]:
    if callable(custom):
        return custom()  # type: ignore[no-any-return]
    return learned(name.split("-")[0], dtype, make)


def payloads(copier: BlockCopier, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (copier.nbytes(len(ids) * TOKENS) + 64,), generator=gen).to(
            torch.uint8
        )
        for ids, _, _ in WRITES
    ]


@pytest.mark.parametrize("slot_blocks", [1, 2, 16], ids=["one-block-slots", "split", "roomy"])
@pytest.mark.parametrize(("name", "dtype", "make", "custom"), LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_ring_writes_and_reads_equal_the_host_path_byte_for_byte(
    name: str, dtype: torch.dtype, make: Make, custom: object, slot_blocks: int
) -> None:
    layouts = layouts_of(name, dtype, make, custom)
    host_caches, ring_caches = (random_caches(make, dtype, seed=21) for _ in range(2))
    host = BlockCopier(host_caches, layouts)
    ring = BlockCopier(
        ring_caches, layouts, use_ring=True, ring_slots=2, slot_bytes=slot_blocks * host.block_bytes
    )
    assert ring.device_bytes >= 2 * host.block_bytes and host.device_bytes == 0
    srcs = payloads(host, seed=22)
    items = [(ids, src, lo, hi) for (ids, lo, hi), src in zip(WRITES, srcs, strict=True)]
    host.write_many(items)
    handle = ring.write_many(items, after=None)
    assert handle.done() and handle.event is None  # CPU: complete on return
    for a, b in zip(host_caches, ring_caches, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    untouched = random_caches(make, dtype, seed=21)  # the writes did change the caches
    assert not any(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(host_caches, untouched, strict=True)
    )

    reads = [[1, 3, 0], [5], list(range(BLOCKS))[::-1]]
    outs = {
        who: [torch.zeros(host.nbytes(len(ids) * TOKENS) + 8, dtype=torch.uint8) for ids in reads]
        for who in ("host", "ring")
    }
    host.read_many(list(zip(reads, outs["host"], strict=True)))
    ring.read_many(list(zip(reads, outs["ring"], strict=True))).wait()
    for a, b in zip(outs["host"], outs["ring"], strict=True):
        assert torch.equal(a, b) and a[:-8].any() and not a[-8:].any()


def test_the_torch_kernel_and_triton_are_the_only_kernels() -> None:
    caches = random_caches(cpu_cache, torch.float32, seed=1)
    with pytest.raises(ValueError, match="auto, triton or torch"):
        BlockCopier(caches, shuffled_layouts(), use_ring=True, kernel="cuda-graphs")


# -- the Triton kernel under Triton's interpreter -------------------------------------
TRITON_PROGRAM = textwrap.dedent(
    """
    import torch
    from tests.vllm_connector.test_layout import BLOCKS, HEADS, TOKENS, flash_cache, flash_writer
    from vllm_connector.blockcopy import BlockCopier
    from vllm_connector.layout import probe_layout

    LAYERS = 3
    for dtype in (torch.float16, torch.float32):
        layout = probe_layout(flash_cache(dtype), flash_writer, HEADS, 32)
        # one tensor, layers in reverse order: the kernel's layer offsets are negative
        big = torch.randn(LAYERS, BLOCKS, TOKENS, HEADS, 64).to(dtype)
        caches = [big[LAYERS - 1 - l].transpose(1, 2) for l in range(LAYERS)]
        twins = [c.clone() for c in caches]
        host = BlockCopier(twins, [layout] * LAYERS)
        ring = BlockCopier(caches, [layout] * LAYERS, use_ring=True, kernel="triton",
                           slot_bytes=2 * host.block_bytes)
        assert ring._ring.kernel == "triton"
        src = torch.randint(0, 256, (host.nbytes(3 * TOKENS),), dtype=torch.uint8)
        items = [([4, 0, 2], src, 7, 3 * TOKENS - 1)]
        host.write_many(items)
        ring.write_many(items)
        u8 = torch.uint8
        same = [torch.equal(a.view(u8), t.view(u8)) for a, t in zip(caches, twins)]
        assert all(same), f"write: layers equal {same}"
        outs = [torch.zeros(host.nbytes(4 * TOKENS), dtype=torch.uint8) for _ in range(2)]
        host.read_many([([1, 5, 3, 0], outs[0])])
        ring.read_many([([1, 5, 3, 0], outs[1])])
        assert torch.equal(outs[0], outs[1]) and outs[0].any(), "read"

    # the start-up check: it leaves the caches as they were, and on zeroed caches (vLLM's)
    # it still fails a kernel that moves the wrong bytes (here: every layer as layer 0)
    from vllm_connector.ring_kernel import TritonMove
    big = torch.randn(LAYERS, BLOCKS, TOKENS, HEADS, 64)
    before = big.clone()
    rows = [layout.blocks_view(big[l].transpose(1, 2)) for l in range(LAYERS)]
    slot = torch.zeros(2 * LAYERS * rows[0][0].numel() * 4, dtype=torch.uint8)
    move = TritonMove(rows, slot.numel())
    move.check(slot)
    assert torch.equal(big, before), "the check changed the caches"
    big.zero_()
    move.layer_words = torch.zeros_like(move.layer_words)
    try:
        move.check(slot)
    except RuntimeError as exc:
        assert "other bytes" in str(exc), exc
    else:
        raise AssertionError("a kernel that moves layer 0 for every layer passed the check")
    print("triton interpreter: ok")
    """
)


def test_the_triton_kernel_under_the_interpreter_equals_the_host_path() -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("no Triton in this environment")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", TRITON_PROGRAM],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if (
        run.returncode != 0
        and "interpret" in run.stderr.lower()
        and "AssertionError" not in run.stderr
    ):
        pytest.skip(f"Triton's interpreter cannot run here: {run.stderr[-500:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "triton interpreter: ok" in run.stdout


def test_the_triton_kernel_compiles_for_a_hopper_gpu_with_16_byte_accesses() -> None:
    """Compiled (no GPU needed: Triton's own ptxas) for sm_90 with int64 words, 16-byte
    aligned rows and layer offsets: every row access is a 16-byte vector (`v2.b64`), on the
    slot's side and the cache's; only the per-entry indices are scalar loads."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError:
        pytest.skip("no Triton in this environment")
    from vllm_connector.ring_kernel import _move_rows_kernel

    signature = dict.fromkeys(("slot", "base", "layer_words", "rows", "steps", "blocks"), "*i64")
    signature |= dict.fromkeys(("ROW", "STRIDE", "BLOCK", "ALIGN", "GATHER"), "constexpr")
    for gather in (False, True):
        source = triton.compiler.ASTSource(
            fn=_move_rows_kernel(),
            signature=signature,
            constexprs={"ROW": 4096, "STRIDE": 4096, "BLOCK": 1024, "ALIGN": 2, "GATHER": gather},
            attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Triton 3.9's FP-fusion default notice
            try:
                ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
            except (RuntimeError, OSError) as exc:
                if "ptxas" in str(exc):
                    pytest.skip(f"Triton cannot compile for CUDA here: {exc}")
                raise
        accesses = set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))
        assert accesses == {"ld.global.b64", "ld.global.v2.b64", "st.global.v2.b64"}, accesses


def test_the_index_rows_alignment_compiles_no_new_variant() -> None:
    """Triton keys a compiled variant on each pointer argument's 16-byte alignment (its
    binder calls `native_specialize_impl` with each parameter's `do_not_specialize*`
    flags). The index rows are views at offsets that change from call to call: they must
    not be in the key, or loads would compile new variants (the start-up check compiles
    the ones a ring uses); `slot` and `base` keep theirs (their accesses are vectors)."""
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import native_specialize_impl
    except ImportError:
        pytest.skip("no Triton (or another Triton API) in this environment")
    from vllm_connector.ring_kernel import INDEX_ARGS, _move_rows_kernel

    words = torch.zeros(8, dtype=torch.long)
    aligned, odd = words[0:], words[1:]
    assert aligned.data_ptr() % 16 == 0 and odd.data_ptr() % 16 == 8
    pointers = [p for p in _move_rows_kernel().params if not p.is_constexpr]
    assert [p.name for p in pointers] == ["slot", "base", *INDEX_ARGS]
    for p in pointers:
        keys = {
            native_specialize_impl(
                BaseBackend, t, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment
            )
            for t in (aligned, odd)
        }
        assert len(keys) == (1 if p.name in INDEX_ARGS else 2), (p.name, keys)
