"""A bounded copy engine between host payloads and the paged KV cache, through a fixed ring.

A load used to copy every piece into a fresh device tensor the size of the load, so it took
twice its own size in GPU memory (~8 GiB for a 32k-token Llama-3-8B history). Here a load
moves through a **ring** of a few fixed device slots allocated once (`Ring.device_bytes`):
each *fill* is host->device DMA of whole pieces (or of a run of blocks of a piece larger
than a slot) into one slot, then one scatter of that slot into every layer's blocks. A
store is the mirror image: a gather into a slot, then DMA of the slot into the host payload.

Three layers, so that CPU CI tests all but the last:

- **the planner** (`plan`, pure Python): packs the pieces of a call into fills, each a list
  of host byte ranges (`Span`) and of (slot row -> cache block, token range) entries,
  splitting pieces larger than a slot and marking partial first/last blocks;
- **the executor** (`Ring.write` / `Ring.read`, torch): runs a plan on any device; on CPU
  the same code runs without streams or events, so tests compare it byte for byte to the
  copier's host path;
- **the CUDA specifics**, thin on top: two side streams (`dma` for host<->slot, `kernel` for
  slot<->cache), one event per slot so a slot is reused only once its previous scatter (or
  DMA out) ran — a wait on the GPU, never the host — and the scatter/gather as one Triton
  kernel over all layers and entries (`vllm_connector.ring_kernel`, checked against torch
  at start-up) where torch ships Triton, else one `index_copy_` / `index_select` per
  layer. The block indices of a call go up in one copy from a pinned buffer reused
  between calls (no pinned allocation per load).

Within one call a cache block is written once (a load's blocks are distinct): whole blocks
of a fill are scattered before its partial ones are merged, as in the host path.

Ordering: the cache is touched only after `after` (an event the caller recorded on the
stream that computes, vLLM's), and the returned `Copies` handle carries the event of the
last copy, so a caller can wait on the host (`wait`), poll (`done`) or make a stream wait.

torch only (Triton optional): this runs where vLLM is absent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from vllm_connector.ordering import Copies
from vllm_connector.ring_kernel import TritonMove, triton_move

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 2
DEFAULT_SLOT_BYTES = 32 << 20


class Piece(NamedTuple):
    """One piece of a call: payload blocks `i` go to (or come from) cache block
    `block_ids[i]`; tokens `[lo, hi)` of the piece are moved (a read moves every block).
    The payload `[L, len(block_ids), elems]` starts `offset` bytes into item `item`'s buffer."""

    block_ids: Sequence[int]
    lo: int
    hi: int
    item: int
    offset: int = 0


class Span(NamedTuple):
    """Bytes `[host, host + nbytes)` of item `item`'s buffer <-> `[slot, slot + nbytes)` of the
    ring slot: one DMA copy."""

    item: int
    host: int
    slot: int
    nbytes: int


class Entry(NamedTuple):
    """One payload block of every layer: layer `l`'s row is slot row `row + l * step`; it
    belongs to cache block `block`, tokens `[lo, hi)` of the block (`(0, N)`: all of it)."""

    row: int
    step: int
    block: int
    lo: int
    hi: int


class Fill(NamedTuple):
    """What one use of a ring slot moves: DMA `spans`, whole blocks `whole` (one scatter or
    gather), blocks only partly moved `edges` (merged token by token), `rows` rows used."""

    spans: tuple[Span, ...]
    whole: tuple[Entry, ...]
    edges: tuple[Entry, ...]
    rows: int


def plan(
    pieces: Sequence[Piece],
    *,
    tokens: int,
    layers: int,
    row_bytes: int,
    slot_bytes: int,
    blocks: int,
) -> list[Fill]:
    """Pack `pieces` into fills of a slot of `slot_bytes` (rows of `row_bytes`, `layers` per
    payload block, `tokens` per block, `blocks` in each layer's cache), in order. A piece
    that fits a slot but not the rows left in this one starts the next fill; only a piece
    larger than a slot is split between blocks (one DMA per layer for each part). A slot
    holds at least one block of every layer, else ValueError."""
    slot_rows = slot_bytes // row_bytes
    if slot_rows < layers:
        raise ValueError(f"a slot of {slot_bytes} bytes holds no block of {layers} layers")
    fills: list[Fill] = []
    spans: list[Span] = []
    whole: list[Entry] = []
    edges: list[Entry] = []
    used = 0
    for piece in pieces:
        ids, lo, hi, n = piece.block_ids, piece.lo, piece.hi, tokens
        nb = len(ids)
        if not 0 <= lo <= hi <= nb * n:
            raise ValueError(f"tokens [{lo}, {hi}) are not inside {nb} blocks")
        if lo == hi:
            continue
        first, end = lo // n, -(-hi // n)  # the payload blocks [first, end) that are touched
        for i in range(first, end):
            if not 0 <= ids[i] < blocks:
                raise ValueError(f"block {ids[i]} is not in a cache of {blocks} blocks")
        i = first
        while i < end:
            room = (slot_rows - used) // layers
            # a piece that fits an empty slot is never split (one DMA, not one per layer)
            if room == 0 or (used and end - i <= slot_rows // layers and end - i > room):
                fills.append(Fill(tuple(spans), tuple(whole), tuple(edges), used))
                spans, whole, edges, used = [], [], [], 0
                continue
            k = min(end - i, room)
            if k == nb:  # the whole payload, every layer: one range
                spans.append(
                    Span(piece.item, piece.offset, used * row_bytes, layers * k * row_bytes)
                )
            else:
                for layer in range(layers):
                    host = piece.offset + (layer * nb + i) * row_bytes
                    slot = (used + layer * k) * row_bytes
                    spans.append(Span(piece.item, host, slot, k * row_bytes))
            for j in range(k):
                b = i + j
                a, z = max(lo - b * n, 0), min(hi - b * n, n)
                entry = Entry(used + j, k, ids[b], a, z)
                (whole if (a, z) == (0, n) else edges).append(entry)
            used += layers * k
            i += k
    if used:
        fills.append(Fill(tuple(spans), tuple(whole), tuple(edges), used))
    return fills


def merge_row(
    caches: Sequence[torch.Tensor],
    token_maps: Sequence[torch.Tensor],
    row: torch.Tensor,
    block: int,
    a: int,
    b: int,
) -> None:
    """Tokens [a, b) of `row` (`[L, elems]`, one payload block of every layer) into block
    `block` of every layer's `caches` (`[blocks, elems]` views), its other tokens untouched:
    through a mask of the elements of those tokens (`token_maps[l]`: each element's token)."""
    maps = {id(token): token for token in token_maps}  # layers mostly share one
    masks = {key: (token >= a) & (token < b) for key, token in maps.items()}
    for layer, (dst, token) in enumerate(zip(caches, token_maps, strict=True)):
        cell = dst[block]
        torch.where(masks[id(token)], row[layer], cell, out=cell)


class Ring:
    """The ring slots, their events and the executor (module docstring).

    `rows[l]` is layer `l`'s cache as `[blocks, elems]` (`BlockLayout.blocks_view`);
    `token_maps[l]` each element's token in a block (for partial blocks). `kernel` is
    "triton", "torch" or "auto" (Triton on CUDA where it imports, else torch).
    """

    def __init__(
        self,
        rows: Sequence[torch.Tensor],
        token_maps: Sequence[torch.Tensor],
        tokens: int,
        *,
        slots: int = DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        kernel: str = "auto",
    ) -> None:
        self.rows, self.token_maps, self.tokens = list(rows), list(token_maps), tokens
        first = self.rows[0]
        self.device, self.dtype = first.device, first.dtype
        self.elems = int(first.shape[1])
        self.row_bytes = self.elems * first.element_size()
        self.blocks = int(first.shape[0])
        need = len(self.rows) * self.row_bytes
        if slot_bytes < need:
            log.info("ring slots of %d bytes grown to one block of every layer", slot_bytes)
            slot_bytes = need
        self.slot_bytes = slot_bytes // self.row_bytes * self.row_bytes  # whole rows
        self.slots = [
            torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(slots)
        ]
        self._free: list[Any] = [None] * slots  # per slot: the event of its last use
        self._next = 0
        self.timing = False  # events with timing (benchmarks: `elapsed_time` from the handle's)
        self._lock = threading.Lock()  # loads (a loader thread) and stores (vLLM's) share it
        cuda = self.device.type == "cuda"
        self._dma = torch.cuda.Stream(self.device) if cuda else None
        self._kernel = torch.cuda.Stream(self.device) if cuda else None
        self._triton: TritonMove | None = triton_move(kernel, self.rows, self.slots[0])
        self.kernel = "triton" if self._triton is not None else "torch"
        self._index_host: torch.Tensor | None = None  # pinned (CUDA), reused between calls
        self._index_dev: torch.Tensor | None = None
        self._index_ready: Any = None  # the event after the last upload out of `_index_host`

    @property
    def device_bytes(self) -> int:
        """Device memory the ring holds: its slots and its index buffer."""
        index = self._index_dev.numel() * 8 if self._index_dev is not None else 0
        return len(self.slots) * self.slot_bytes + index

    # -- the executor -------------------------------------------------------------------
    def write(
        self, pieces: Sequence[Piece], bufs: Sequence[torch.Tensor], after: Any = None
    ) -> Copies:
        """Payloads -> cache: `pieces` (their payloads in `bufs[piece.item]`, flat uint8 on
        the host), each block's tokens [lo, hi). The cache is touched only after `after`
        (None: after the calling thread's current stream)."""
        with self._lock:
            fills = self._plan(pieces)
            if not fills:
                return Copies(None)
            index = self._upload(fills)
            self._wait_for(self._kernel, after)
            last = None
            for fill, at in zip(fills, index, strict=True):
                s, slot = self._take()
                with self._on(self._dma):
                    self._wait_for(self._dma, self._free[s], default=False)
                    for span in fill.spans:
                        src = bufs[span.item][span.host : span.host + span.nbytes]
                        slot[span.slot : span.slot + span.nbytes].copy_(src, non_blocking=True)
                    filled = self._record(self._dma)
                with self._on(self._kernel):
                    self._wait_for(self._kernel, filled, default=False)
                    self._move(slot, at, fill, gather=False)
                    for e in fill.edges:
                        merge_row(
                            self.rows, self.token_maps, self._row(slot, e), e.block, e.lo, e.hi
                        )
                    last = self._free[s] = self._record(self._kernel)
            return Copies(last, bufs)

    def read(
        self, pieces: Sequence[Piece], bufs: Sequence[torch.Tensor], after: Any = None
    ) -> Copies:
        """Cache -> payloads: every block of `pieces` into `bufs[piece.item]` (lo and hi
        must span the piece). The cache is read only after `after` (as `write`)."""
        with self._lock:
            fills = self._plan(pieces)
            if not fills:
                return Copies(None)
            index = self._upload(fills)
            self._wait_for(self._kernel, after)
            last = None
            for fill, at in zip(fills, index, strict=True):
                if fill.edges:
                    raise ValueError("a read moves whole blocks")
                s, slot = self._take()
                with self._on(self._kernel):
                    self._wait_for(self._kernel, self._free[s], default=False)
                    self._move(slot, at, fill, gather=True)
                    gathered = self._record(self._kernel)
                with self._on(self._dma):
                    self._wait_for(self._dma, gathered, default=False)
                    for span in fill.spans:
                        dst = bufs[span.item][span.host : span.host + span.nbytes]
                        dst.copy_(slot[span.slot : span.slot + span.nbytes], non_blocking=True)
                    last = self._free[s] = self._record(self._dma)
            return Copies(last, bufs)

    def synchronize(self) -> None:
        """Block until every copy issued so far ran; the current stream is then ordered
        after them too (as the copier's `wait` always did)."""
        for stream in (self._dma, self._kernel):
            if stream is not None:
                stream.synchronize()
                torch.cuda.current_stream(self.device).wait_stream(stream)

    def _plan(self, pieces: Sequence[Piece]) -> list[Fill]:
        return plan(
            pieces,
            tokens=self.tokens,
            layers=len(self.rows),
            row_bytes=self.row_bytes,
            slot_bytes=self.slot_bytes,
            blocks=self.blocks,
        )

    def _take(self) -> tuple[int, torch.Tensor]:
        s = self._next
        self._next = (s + 1) % len(self.slots)
        return s, self.slots[s]

    def _row(self, slot: torch.Tensor, e: Entry) -> torch.Tensor:
        """Entry `e`'s rows in `slot`, `[L, elems]` (a strided view, no copy)."""
        rows = slot.view(self.dtype)
        return rows.as_strided(
            (len(self.rows), self.elems), (e.step * self.elems, 1), e.row * self.elems
        )

    def _upload(self, fills: Sequence[Fill]) -> list[torch.Tensor]:
        """Every fill's whole entries (rows, steps, blocks: `[3, n]` int64) on the device, in
        one copy from a pinned buffer reused between calls (on the `dma` stream, before
        the fills' DMA; the `kernel` stream waits for it)."""
        total = sum(len(f.whole) for f in fills)
        flat = [e.row for f in fills for e in f.whole]
        flat += [e.step for f in fills for e in f.whole]
        flat += [e.block for f in fills for e in f.whole]
        if self._dma is None:  # CPU: the host index is the index
            host = torch.tensor(flat, dtype=torch.long).view(3, total)
            return _split(host, fills)
        if self._index_ready is not None:
            self._index_ready.synchronize()  # the last upload out of the pinned buffer ran
        if self._index_host is None or self._index_host.numel() < 3 * total:
            size = max(3 * total, 4096)
            self._index_host = _pinned(size)
            with self._on(self._dma):
                self._index_dev = torch.empty(size, dtype=torch.long, device=self.device)
        assert self._index_dev is not None and self._dma is not None and self._kernel is not None
        self._index_host[: 3 * total].copy_(torch.tensor(flat, dtype=torch.long))
        with self._on(self._dma):
            # the previous call's kernels read the device buffer: they must have run
            self._dma.wait_stream(self._kernel)
            dev = self._index_dev[: 3 * total]
            dev.copy_(self._index_host[: 3 * total], non_blocking=True)
            self._index_ready = self._record(self._dma)
        # ... and this call's kernels read it: a read's gather waits for no DMA of its own
        self._kernel.wait_event(self._index_ready)
        return _split(dev.view(3, total), fills)

    def _move(self, slot: torch.Tensor, index: torch.Tensor, fill: Fill, *, gather: bool) -> None:
        """Whole blocks between `slot` and every layer's cache: `index` is `[3, n]` (slot row
        of layer 0, rows between layers, cache block)."""
        if not fill.whole:
            return
        if self._triton is not None:
            self._triton(slot, index, gather=gather)
            return
        slot_rows = slot.view(self.dtype).view(-1, self.elems)
        rows, steps, blocks = index
        for layer, cache in enumerate(self.rows):
            src = rows + layer * steps if layer else rows
            if gather:
                slot_rows.index_copy_(0, src, cache.index_select(0, blocks))
            else:
                cache.index_copy_(0, blocks, slot_rows.index_select(0, src))

    # -- the CUDA seams (no-ops on CPU) -------------------------------------------------
    @contextlib.contextmanager
    def _on(self, stream: Any) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    def _record(self, stream: Any) -> Any:
        if stream is None:
            return None
        event = torch.cuda.Event(enable_timing=self.timing)
        event.record(stream)
        return event

    def _wait_for(self, stream: Any, event: Any, *, default: bool = True) -> None:
        """`stream` waits on the GPU for `event`; with none and `default`, for the calling
        thread's current stream (today's behaviour without an `after`)."""
        if stream is None:
            return
        if event is not None:
            stream.wait_event(event)
        elif default:
            stream.wait_stream(torch.cuda.current_stream(self.device))


def _pinned(size: int) -> torch.Tensor:
    """A pinned int64 host buffer (the seam tests replace on a machine without CUDA)."""
    return torch.empty(size, dtype=torch.long, pin_memory=True)


def _split(index: torch.Tensor, fills: Sequence[Fill]) -> list[torch.Tensor]:
    """`[3, total]` into one `[3, n]` view per fill."""
    out, at = [], 0
    for fill in fills:
        out.append(index[:, at : at + len(fill.whole)])
        at += len(fill.whole)
    return out


__all__ = ["Copies", "Entry", "Fill", "Piece", "Ring", "Span", "merge_row", "plan"]
