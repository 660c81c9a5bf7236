"""The ring's scatter/gather as one Triton kernel over all layers and entries.

`vllm_connector.ring` moves whole blocks between a ring slot and every layer's cache; on
CUDA, where torch ships Triton, it does so with `_move_rows_kernel`: one program per
(entry, layer, chunk of a row), slot row `row + layer * step` <-> block `block` of layer
`layer`. vLLM allocates each layer's cache on its own, so there is no common stride between
layers: the kernel takes a table of each layer's offset, in words, from the first layer's
storage (`TritonMove`). It is compiled and checked against torch's copy at start-up
(`TritonMove.check`, with a pattern of its own), not in the first load; one that fails
the check is not used.

torch only, Triton imported on first use: this runs where vLLM (and Triton) are absent.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

_TRITON_BLOCK = 1024  # words per Triton program (8 KiB of int64)
_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_size(*byte_counts: int) -> int:
    """The widest integer (8, 4, 2 or 1 bytes) dividing every count: the unit the Triton
    kernel moves (an aligned int64 row lets it issue 16-byte vector loads)."""
    for size in (8, 4, 2):
        if all(c % size == 0 for c in byte_counts):
            return size
    return 1


class TritonMove:
    """Whole blocks between a ring slot and every layer's cache (`rows[l]`: layer `l` as
    `[blocks, elems]`), one Triton launch per call. Construction works out the word the
    kernel moves and each layer's offset from layer 0's first block; ValueError where the
    layers differ in block stride."""

    def __init__(self, rows: Sequence[torch.Tensor], slot_bytes: int) -> None:
        self.rows = list(rows)
        first = self.rows[0]
        self.row_bytes = int(first.shape[1]) * first.element_size()
        base = first.data_ptr()
        strides = [r.stride(0) * r.element_size() for r in self.rows]
        if len(set(strides)) != 1:
            raise ValueError(f"layers differ in block stride: {set(strides)}")
        offsets = [r.data_ptr() - base for r in self.rows]
        word = word_size(self.row_bytes, strides[0], base, slot_bytes, *offsets)
        self.word = word
        self.row_words = self.row_bytes // word
        self.stride_words = strides[0] // word
        self.base = torch.as_strided(first.view(torch.uint8).view(_WORD[word]), (1,), (1,))
        words = [o // word for o in offsets]
        # the offsets' common power of two (up to 16 bytes): lets Triton vectorize the
        # cache side as it does the slot's
        self.offset_align = max(
            a for a in (1, 2, 4, 8, 16) if a * word <= 16 and all(w % a == 0 for w in words)
        )
        self.layer_words = torch.tensor(words, dtype=torch.long, device=first.device)

    def check(self, slot: torch.Tensor) -> None:
        """Compile both directions at start-up (not in the first load) and check them
        against torch's copy, with bytes of our own: vLLM allocates its caches zeroed
        (`vllm/v1/worker/utils.py`, `allocate_kv_cache`), so moving the caches' own bytes
        would compare zeros with zeros whatever the kernel read or wrote. The last block of
        every layer gets random bytes (none zero), is gathered into `slot`, zeroed and
        scattered back from it; then it gets its own bytes back."""
        layers, nbytes = len(self.rows), len(self.rows) * self.row_bytes
        last = int(self.rows[0].shape[0]) - 1
        cells = [rows[last].view(torch.uint8) for rows in self.rows]
        saved = torch.stack(cells)
        gen = torch.Generator(device=slot.device).manual_seed(0)
        shape = (layers, self.row_bytes)  # bytes 1..255: none is a zeroed cache's
        pattern = torch.randint(1, 256, shape, dtype=torch.uint8, device=slot.device, generator=gen)
        index = torch.tensor([[0], [1], [last]], dtype=torch.long, device=slot.device)
        try:
            for cell, want in zip(cells, pattern, strict=True):
                cell.copy_(want)
            self(slot, index, gather=True)
            gathered = torch.equal(slot[:nbytes].view(layers, -1), pattern)
            for cell in cells:
                cell.zero_()
            self(slot, index, gather=False)
            scattered = torch.equal(torch.stack(cells), pattern)
        finally:
            for cell, old in zip(cells, saved, strict=True):
                cell.copy_(old)
        if not (gathered and scattered):
            what = "gathered" if not gathered else "scattered"
            raise RuntimeError(f"the Triton kernel {what} other bytes than torch's copy")

    def __call__(self, slot: torch.Tensor, index: torch.Tensor, *, gather: bool) -> None:
        """Whole blocks between `slot` (flat uint8) and every layer's cache: `index` is
        `[3, n]` (slot row of layer 0, rows between layers, cache block), on the device."""
        n = index.shape[1]
        grid = (n, len(self.rows), -(-self.row_words // _TRITON_BLOCK))
        _move_rows_kernel()[grid](
            slot.view(_WORD[self.word]),
            self.base,
            self.layer_words,
            index[0],
            index[1],
            index[2],
            ROW=self.row_words,
            STRIDE=self.stride_words,
            BLOCK=_TRITON_BLOCK,
            ALIGN=self.offset_align,
            GATHER=gather,
        )


def triton_move(kernel: str, rows: Sequence[torch.Tensor], slot: torch.Tensor) -> TritonMove | None:
    """The Triton mover for `kernel` ("auto", "triton" or "torch"), compiled and checked
    (`TritonMove.check`, in `slot`); None where torch's `index_copy_` is to be used: asked
    for, or "auto" where Triton is absent or the kernel fails its check (logged).
    "triton" that fails raises."""
    if pick_kernel(kernel, slot.device) != "triton":
        return None
    try:
        move = TritonMove(rows, slot.numel())
        move.check(slot)
    except Exception:
        if kernel == "triton":
            raise
        log.warning("the ring's Triton kernel failed its check; index_copy_ instead", exc_info=True)
        return None
    return move


def pick_kernel(kernel: str, device: torch.device) -> str:
    """`kernel` ("auto", "triton" or "torch") as the one to use: "auto" is Triton on CUDA
    where it imports, else torch's `index_copy_`."""
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel {kernel!r}: auto, triton or torch")
    if kernel != "auto":
        return kernel
    if device.type != "cuda":
        return "torch"
    try:
        _move_rows_kernel()
    except Exception as exc:  # no Triton in this torch build, or it cannot compile here
        log.info("no Triton (%s): ring scatters are one index_copy_ per layer", exc)
        return "torch"
    return "triton"


_KERNEL: Any = None
INDEX_ARGS = ("layer_words", "rows", "steps", "blocks")  # read a word at a time


def _move_rows_kernel() -> Any:
    """The scatter/gather kernel, built on first use (Triton is imported only then, so
    `TRITON_INTERPRET` set before that first use takes effect).

    One program per (entry, layer, chunk of a row): slot row `row + layer * step` <-> block
    `block` of layer `layer`, at `base + layer_words[layer] + block * STRIDE`. ROW and
    STRIDE are compile-time, so Triton sees the rows' alignment and vectorizes.

    Triton compiles a variant per 16-byte alignment of each pointer argument. `slot` and
    `base` keep that (their accesses are the vectors; both are fixed for a ring's life),
    but the index rows are views into one buffer at offsets that change from call to call,
    and the kernel reads one word of each per program: they (and the layer table) are
    not specialized on alignment, so the two variants the start-up check compiles are the
    only ones a ring ever uses (none is compiled during a load)."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize_on_alignment=INDEX_ARGS)
    def move_rows(
        slot,
        base,
        layer_words,
        rows,
        steps,
        blocks,
        ROW: tl.constexpr,
        STRIDE: tl.constexpr,
        BLOCK: tl.constexpr,
        ALIGN: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        entry = tl.program_id(0)
        layer = tl.program_id(1)
        part = tl.program_id(2)
        row = tl.load(rows + entry)
        step = tl.load(steps + entry)
        block = tl.load(blocks + entry)
        offset = tl.multiple_of(tl.load(layer_words + layer), ALIGN)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        mask = cols < ROW
        in_slot = slot + (row + layer * step) * ROW + cols
        in_cache = base + offset + block * STRIDE + cols
        if GATHER:
            tl.store(in_slot, tl.load(in_cache, mask=mask), mask=mask)
        else:
            tl.store(in_cache, tl.load(in_slot, mask=mask), mask=mask)

    _KERNEL = move_rows
    return _KERNEL


__all__ = ["TritonMove", "pick_kernel", "triton_move", "word_size"]
