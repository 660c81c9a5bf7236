"""Whole kernel blocks between vLLM's paged KV cache and a flat host payload, at copy speed.

The shared-memory data path keeps a piece's KV in **the engine's own block layout**: the
paged payload of a piece of `tokens` tokens is `[L, nb, elems]` of the cache dtype
(nb = ceil(tokens / N)), row `i` of layer `l` being the raw storage of the piece's kernel
block `i` in layer `l`. Moving it is then one row copy per layer and block, with no element
reordering at all, so a load or a store runs at the speed of a plain copy instead of the
~1 GB/s of indexing every element (`layout.gather`/`scatter`). Two engines can read each
other's payloads exactly when their `tag`s (a hash of dtype, shape and block layout) agree.

On CPU each whole block of each layer is one `copy_` between two row views: the cache's
made once (`unbind` of each layer's blocks), the payload's with one `unbind` per piece, so
a block costs a dispatch and its copy (torch's vectorized copy, over its threads), not the
~10 us of slicing two tensors per block, nor `index_copy_`'s element loop (~0.5x a copy),
nor a `memmove` (glibc's `rep movsb` ran at half torch's speed from memory on this CPU).
On CUDA every copy goes through a bounded ring (`vllm_connector.ring`): a few fixed device
slots allocated with the copier (`device_bytes`), filled by DMA from the (pinned, see
`register_host`) host payload and scattered into every layer's blocks by one kernel per
fill, on side streams; a load never stages its own size on the device. `write_many` and
`read_many` touch the caches only after an `after` event (the worker records it on vLLM's
compute stream; None: after the calling thread's current stream) and return a `Copies`
handle (`done()`, `wait()`, `event`); `wait()` joins everything issued. A block only partly
inside a write's token range is merged through a mask of its tokens' elements.

torch only: this runs where vLLM is absent.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from vllm_connector.layout import BlockLayout, TokenSlots, gather, scatter, to_blocks
from vllm_connector.ordering import Copies
from vllm_connector.ring import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS, Piece, Ring, merge_row

log = logging.getLogger(__name__)


def layout_tag(dtype: torch.dtype, layouts: Sequence[BlockLayout]) -> int:
    """A stable positive 31-bit id of a paged payload's format: dtype, layers, tokens per
    block, heads, head size, block elements and every layer's element offsets."""
    first = layouts[0]
    digest = hashlib.blake2b(digest_size=8)
    head = f"{dtype}|{len(layouts)}|{first.tokens}|{first.heads}|{first.head_dim}|{first.elems}"
    digest.update(head.encode())
    previous: torch.Tensor | None = None
    for layout in layouts:
        offsets = layout.offsets.cpu()
        if previous is not None and torch.equal(offsets, previous):
            digest.update(b"=")  # the same as the layer before: skip hashing it again
            continue
        digest.update(offsets.contiguous().numpy().astype("<i8").tobytes())
        previous = offsets
    return int.from_bytes(digest.digest()[:4], "little") & 0x7FFFFFFF or 1


class BlockCopier:
    """Copies between every layer's paged cache and paged payloads (module docstring).

    `block_ids` are kernel block ids (`kernel_blocks` turns scheduler blocks into them):
    `block_ids[i]` is where the piece's payload block `i` lives in every layer's cache.
    `ring_slots` x `slot_bytes` is the ring's size (grown to one block of every layer if
    smaller) and `kernel` its scatter ("auto": Triton on CUDA where it imports, else torch's
    `index_copy_`); they matter where the ring runs: on CUDA, or anywhere with `use_ring`.
    """

    def __init__(
        self,
        caches: list[torch.Tensor],
        layouts: list[BlockLayout],
        *,
        ring_slots: int = DEFAULT_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        kernel: str = "auto",
        use_ring: bool | None = None,
    ) -> None:
        if not caches or len(caches) != len(layouts):
            raise ValueError(f"{len(caches)} caches for {len(layouts)} layouts")
        first = layouts[0]
        same = {
            (lay.tokens, lay.elems, c.dtype, c.device)
            for c, lay in zip(caches, layouts, strict=True)
        }
        if len(same) != 1:
            raise ValueError(f"layers differ in block size, elements, dtype or device: {same}")
        self.caches, self.layouts = caches, layouts
        self.tokens, self.elems = first.tokens, first.elems
        self.dtype, self.device = caches[0].dtype, caches[0].device
        self.row_bytes = first.elems * caches[0].element_size()
        self.block_bytes = len(caches) * self.row_bytes
        self.tag = layout_tag(self.dtype, layouts)
        self._rows = [lay.blocks_view(c) for c, lay in zip(caches, layouts, strict=True)]
        # (CPU) every block of every layer as a row view, made once: `[layer][block]`
        self._row_views = (
            [rows.view(torch.uint8).unbind(0) for rows in self._rows]
            if self.device.type == "cpu"
            else []
        )
        self._blocks = self._rows[0].shape[0]
        self._token_of = _token_maps(layouts)
        # (CUDA) the bounded ring every copy goes through, allocated once; `use_ring` forces
        # it on or off (tests run it on CPU, where the row copies above are faster)
        self._ring = (
            Ring(
                self._rows,
                self._token_of,
                self.tokens,
                slots=ring_slots,
                slot_bytes=slot_bytes,
                kernel=kernel,
            )
            if (self.device.type == "cuda" if use_ring is None else use_ring)
            else None
        )
        if self._ring is not None:
            log.info(
                "ctxcache copier: a ring of %d x %d bytes on %s (%s kernel)",
                len(self._ring.slots),
                self._ring.slot_bytes,
                self.device,
                self._ring.kernel,
            )
        self._pending: list[Copies] = []  # copies in flight, for `wait()`

    def nbytes(self, tokens: int) -> int:
        """Bytes of the paged payload of a piece of `tokens` tokens."""
        return math.ceil(tokens / self.tokens) * self.block_bytes

    def read(self, block_ids: Sequence[int], out: torch.Tensor) -> Copies:
        """Engine -> payload: blocks `block_ids` of every layer into `out` (host, uint8).
        On CUDA the copy is only issued: `out` is complete once the handle (or `wait()`)
        says so."""
        return self.read_many([(block_ids, out)])

    def write(self, block_ids: Sequence[int], src: torch.Tensor, lo: int, hi: int) -> Copies:
        """Payload -> engine: tokens `[lo, hi)` of the piece in `src` (host, uint8) into its
        blocks `block_ids`. Whole blocks are row copies; a block only partly inside
        `[lo, hi)` is merged element-wise, so its other tokens keep their values.
        On CUDA the copy is only issued: it is in the cache once the handle (or `wait()`)
        says so, and `src` must not change before then."""
        return self.write_many([(block_ids, src, lo, hi)])

    def write_many(
        self, items: Sequence[tuple[Sequence[int], torch.Tensor, int, int]], after: Any = None
    ) -> Copies:
        """`write` of several pieces `(block_ids, src, lo, hi)`, e.g. every block of a load.
        On CUDA through the ring (`vllm_connector.ring`): the caches are touched only after
        `after` (an event; None: after the calling thread's current stream), and the
        returned handle's event follows the last copy. On CPU the copies are done on return."""
        if self._ring is None:
            self._host_write_many(items)
            return Copies(None)
        bufs = [src for _, src, _, _ in items]
        for ids, src, _, _ in items:
            self._payload_bytes(src, len(ids))
        pieces = [Piece(ids, lo, hi, k) for k, (ids, _, lo, hi) in enumerate(items)]
        return self._track(self._ring.write(pieces, bufs, after))

    def read_many(
        self, items: Sequence[tuple[Sequence[int], torch.Tensor]], after: Any = None
    ) -> Copies:
        """`read` of several pieces `(block_ids, out)`: on CUDA through the ring, ordered
        after `after` as `write_many` is; the handle says when every `out` is complete."""
        if self._ring is None:
            self._host_read_many(items)
            return Copies(None)
        bufs = [out for _, out in items]
        for ids, out in items:
            self._payload_bytes(out, len(ids))
        n = self.tokens
        pieces = [Piece(ids, 0, len(ids) * n, k) for k, (ids, _) in enumerate(items)]
        return self._track(self._ring.read(pieces, bufs, after))

    def _track(self, copies: Copies) -> Copies:
        """Remember `copies` for `wait()`, forgetting those that are done."""
        self._pending = [c for c in self._pending if not c.done()]
        self._pending.append(copies)
        return copies

    @property
    def ring(self) -> Ring | None:
        """The ring copies go through (CUDA, or `use_ring`); None for the host path."""
        return self._ring

    @property
    def device_bytes(self) -> int:
        """Device memory the copier holds for copies (CUDA: its ring; 0 on CPU)."""
        return self._ring.device_bytes if self._ring is not None else 0

    def wait(self) -> None:
        """Block until every copy issued so far is complete (CUDA: the ring's streams are
        drained and the current stream ordered after them; CPU copies are synchronous)."""
        if self._ring is not None:
            self._ring.synchronize()
        self._pending.clear()

    def scatter_2ltd(self, slots: TokenSlots, kv: torch.Tensor) -> None:
        """`kv` (`[2, L, H, T, D]`, LMCache's KV_2LTD) into `slots` (`layout.scatter`)."""
        scatter(self.caches, self.layouts, slots, kv)

    def write_2ltd(self, block_ids: Sequence[int], kv: torch.Tensor, lo: int, hi: int) -> bool:
        """(CPU) Tokens `[lo, hi)` of a piece `kv` in LMCache's KV_2LTD (`[2, L, H, T, D]`, a
        view of the wire's `[2, L, T, H, D]`, T a whole number of kernel blocks) into its
        blocks `block_ids`, as `write` does for a payload in the engine's layout: the piece
        is put into that layout first, every layer in one or two strided copies
        (`layout.to_blocks`), then written as rows. False, nothing written, where that does
        not apply (CUDA, a piece that ends inside a block, a layout that is not affine): the
        caller scatters instead."""
        wire = kv.transpose(2, 3)
        blocks = len(block_ids)
        if (
            self.device.type != "cpu"
            or not wire.is_contiguous()
            or wire.shape[2] != blocks * self.tokens
            or kv.dtype != self.dtype
        ):
            return False
        stage = torch.empty(blocks * self.block_bytes, dtype=torch.uint8)
        if not to_blocks(self.layouts, wire, self._payload(stage, blocks)):
            return False
        self._host_write_many([(block_ids, stage, lo, hi)])
        return True

    def gather_2ltd(self, slots: TokenSlots) -> torch.Tensor:
        """`slots` as `[2, L, H, T, D]` on the caches' device (`layout.gather`)."""
        return gather(self.caches, self.layouts, slots)

    # -- row copies ---------------------------------------------------------------------
    def _payload(self, buf: torch.Tensor, blocks: int) -> torch.Tensor:
        """`buf` (flat uint8, at least the payload's bytes) as `[L, blocks, elems]`."""
        return self._payload_bytes(buf, blocks).view(self.dtype).view(len(self.caches), blocks, -1)

    def _payload_bytes(self, buf: torch.Tensor, blocks: int) -> torch.Tensor:
        """`buf` (flat uint8, at least the payload's bytes) as its first payload's bytes."""
        need = blocks * self.block_bytes
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ValueError(f"a payload is a flat uint8 tensor, got {buf.dtype} {buf.shape}")
        if buf.numel() < need:
            raise ValueError(f"{blocks} blocks need {need} bytes, the buffer has {buf.numel()}")
        return buf[:need]

    def _host_write_many(
        self, items: Sequence[tuple[Sequence[int], torch.Tensor, int, int]]
    ) -> None:
        """(CPU) `write_many`: a row copy per whole block and layer, then the partial blocks
        merged through their token masks."""
        n, layers = self.tokens, len(self._rows)
        edges: list[tuple[torch.Tensor, int, int, int]] = []
        for ids, src, lo, hi in items:
            payload = self._payload_bytes(src, len(ids))
            if not 0 <= lo <= hi <= len(ids) * n:
                raise ValueError(f"tokens [{lo}, {hi}) are not inside {len(ids)} blocks")
            rows = payload.view(layers * len(ids), self.row_bytes).unbind(0)
            for i in range(lo // n, -(-hi // n)):
                block = self._block(ids[i])
                if not (lo <= i * n and (i + 1) * n <= hi):  # only partly inside [lo, hi)
                    row = self._payload(src, len(ids))[:, i]
                    edges.append((row, block, max(lo - i * n, 0), min(hi - i * n, n)))
                    continue
                for layer, views in enumerate(self._row_views):
                    views[block].copy_(rows[layer * len(ids) + i])
        for row, block, a, b in edges:
            self._merge_row(row, block, a, b)

    def _host_read_many(self, items: Sequence[tuple[Sequence[int], torch.Tensor]]) -> None:
        """(CPU) `read_many`: a row copy per block and layer."""
        layers = len(self._rows)
        for ids, out in items:
            payload = self._payload_bytes(out, len(ids))
            rows = payload.view(layers * len(ids), self.row_bytes).unbind(0)
            for i, b in enumerate(ids):
                block = self._block(b)
                for layer, views in enumerate(self._row_views):
                    rows[layer * len(ids) + i].copy_(views[block])

    def _block(self, block: int) -> int:
        """A kernel block id checked against the cache (a negative one would index from
        the end)."""
        if not 0 <= block < self._blocks:
            raise ValueError(f"block {block} is not in a cache of {self._blocks} blocks")
        return block

    def _merge_row(self, row: torch.Tensor, block: int, a: int, b: int) -> None:
        """Tokens [a, b) of `row` (`[L, elems]`) into kernel block `block` (`ring.merge_row`)."""
        merge_row(self._rows, self._token_of, row, block, a, b)


def _token_maps(layouts: Sequence[BlockLayout]) -> list[torch.Tensor]:
    """Per layer, the token (0..N-1) of each element of a block, -1 for padding; layers
    with the same offsets share one map."""
    maps: list[torch.Tensor] = []
    for layout in layouts:
        if maps and torch.equal(layout.offsets, layouts[len(maps) - 1].offsets):
            maps.append(maps[-1])
            continue
        token = torch.full((layout.elems,), -1, dtype=torch.int32, device=layout.offsets.device)
        of = torch.arange(layout.tokens, dtype=torch.int32, device=token.device)
        token[layout.offsets.flatten()] = of.view(1, -1, 1, 1).expand_as(layout.offsets).flatten()
        maps.append(token)
    return maps


def kernel_blocks(
    block_ids: Sequence[int], block_size: int, kernel_tokens: int, start: int, end: int
) -> list[int]:
    """Kernel block ids holding tokens `[start, end)` of a request whose scheduler blocks
    (of `block_size` tokens, each `block_size / kernel_tokens` kernel blocks) are
    `block_ids`; `start` is a multiple of `kernel_tokens`."""
    if start % kernel_tokens:
        raise ValueError(f"token {start} does not start a {kernel_tokens}-token block")
    per = block_size // kernel_tokens
    return [
        block_ids[t // block_size] * per + (t % block_size) // kernel_tokens
        for t in range(start, end, kernel_tokens)
    ]


REGISTER_CHUNK_BYTES = 64 << 30
"""The most bytes one `cudaHostRegister` call pins (vLLM registers large regions in
chunks too: one call over a 72 GiB region fails on some drivers); tests shrink it."""


def register_host(t: torch.Tensor) -> bool:
    """Page-lock `t`'s memory (`cudaHostRegister`, in chunks of `REGISTER_CHUNK_BYTES`) so
    host <-> device copies of it are asynchronous DMA. False (logged) without CUDA or when
    the driver refuses a chunk — then the chunks already registered are unregistered, and
    `t` stays pageable; a tensor that is already pinned is left as it is (True)."""
    if not torch.cuda.is_available():
        log.info("no CUDA: host memory stays pageable")
        return False
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        log.warning("cannot register %s %s tensor", t.device, tuple(t.shape))
        return False
    if t.is_pinned():
        return True
    cudart = torch.cuda.cudart()
    done: list[int] = []
    for ptr, nbytes in _chunks(t):
        err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
        if err:
            _drain_cuda_error()
            log.warning(
                "cudaHostRegister of %d bytes (chunk %d of %s) failed (cudaError %d)",
                nbytes,
                len(done),
                t.numel() * t.element_size(),
                err,
            )
            for registered in done:
                if int(cudart.cudaHostUnregister(registered)):
                    _drain_cuda_error()
            return False
        done.append(ptr)
    return True


def unregister_host(t: torch.Tensor) -> bool:
    """Undo `register_host` (`cudaHostUnregister` of each chunk); False (logged) if it was
    not registered or a chunk could not be unregistered."""
    if not torch.cuda.is_available() or t.device.type != "cpu" or not t.is_pinned():
        return False
    cudart = torch.cuda.cudart()
    ok = True
    for ptr, _ in _chunks(t):
        err = int(cudart.cudaHostUnregister(ptr))
        if err:
            _drain_cuda_error()
            log.warning("cudaHostUnregister failed (cudaError %d)", err)
            ok = False
    return ok


def _chunks(t: torch.Tensor) -> list[tuple[int, int]]:
    """`t`'s memory as `(address, bytes)` chunks of at most `REGISTER_CHUNK_BYTES`."""
    base, total = t.data_ptr(), t.numel() * t.element_size()
    step = REGISTER_CHUNK_BYTES
    return [(base + at, min(step, total - at)) for at in range(0, total, step)]


def _drain_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call.

    A failed `cudaHostRegister` stays as the thread's last error, and torch's next kernel
    launch check (`cudaGetLastError`) would raise it for an unrelated op. torch's cudart
    binding has no `cudaGetLastError`, so it is called in every libcudart this process has
    mapped (opening a loaded library's path returns that library; nothing new is loaded).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libcudart" in line}
    except OSError:
        return
    for path in paths:
        path = path.removesuffix(" (deleted)")
        if "libcudart" not in os.path.basename(path):
            continue
        try:
            ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).cudaGetLastError()
        except (OSError, AttributeError):
            log.debug("cannot reset the CUDA error through %s", path)


__all__ = [
    "REGISTER_CHUNK_BYTES",
    "BlockCopier",
    "Copies",
    "kernel_blocks",
    "layout_tag",
    "register_host",
    "unregister_host",
]
