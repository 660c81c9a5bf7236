"""The connector's worker half: writes loaded blocks into vLLM's paged cache before the
forward pass and reads finished requests' blocks out of it for the sidecar.

Two data paths (docs/vllm.md, "KV paths"):
- **shm**, when the sidecar runs on this node (`local_dir`): one round trip leases the
  blocks, the copies go straight from the sidecar's shared region into vLLM's blocks (the
  blocks are stored in vLLM's own block layout, so a load is a few large copies per layer,
  `vllm_connector.blockcopy`), and a release confirms that nothing raced them. A store
  copies vLLM's blocks into slots the sidecar allocated, then commits them.
- **tcp** (lm://, a remote sidecar, or whatever the shm path cannot serve): a load's
  blocks come in one pipelined round trip of GETs (LMCache's `KV_2LTD`); each piece is put
  into vLLM's block layout, every layer at once (a strided copy or two), then written as
  whole-block row copies as the shm path does (`BlockCopier.write_2ltd`; on CUDA, and for
  a piece that ends inside a block, one scatter per layer).
By default loads are synchronous (the step's forward attends over them); with `async_loads`
they run on one background thread while the engine steps on, and a request whose load is
whole is reported in `take_loaded` (vLLM's `finished_recving`), with its failed blocks.
A block that is missing, unreadable or not the KV we store makes the rest of that load
fail: its vLLM blocks are reported to the scheduler (`get_block_ids_with_load_errors`; for
an async load in the same step as its request), which recomputes them — a miss, never a
wrong answer.
Stores copy the blocks out with one gather per layer (the request's blocks are freed as
soon as that copy is made) and PUT them from a background thread
(`worker.kv.sidecar.SidecarKV`, the built-in worker's storer, with its circuit breaker).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from ctxcache import tracing
from ctxcache.lmcache_keys import parse_key
from sidecar.local_client import TCP, Lease, LocalClient, LocalError, Region, Slot
from sidecar.protocol import FMT_ENGINE_BLOCKS, FMT_KV_2LTD
from vllm_connector.blockcopy import BlockCopier, kernel_blocks, register_host, unregister_host
from vllm_connector.config import ConnectorConfig
from vllm_connector.layout import (
    BlockLayout,
    CacheWriter,
    gather,
    probe_layout,
    token_slots,
)
from vllm_connector.plan import LoadSpec, Piece, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.stats import Counters
from worker.kv.layout import KVShape
from worker.kv.sidecar import SidecarKV, StoreJob, kv_client_factory

log = logging.getLogger(__name__)

_GET_GROUP = 2  # blocks per GET round trip of a TCP load (the next group arrives meanwhile)


class WorkerSide:
    def __init__(self, config: ConnectorConfig, block_size: int, rank: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self.rank = rank
        self.counters = Counters()
        self.caches: list[torch.Tensor] = []
        self.layouts: list[BlockLayout] = []
        self.sidecar: SidecarKV | None = None
        self.copier: BlockCopier | None = None
        self.local: LocalClient | None = None
        # the local sidecars' regions as bytes, per generation: (tensor, pinned for DMA);
        # an earlier generation's goes (unpinned) once no copy uses it (`_let_go`)
        self._regions: dict[str, tuple[torch.Tensor, bool]] = {}
        self._region_users: dict[str, int] = {}
        self._generation: str | None = None
        self._regions_lock = threading.Lock()
        self._sent: set[str] = set()
        self._invalid: set[int] = set()
        self._loader: ThreadPoolExecutor | None = None  # (async_loads) started on first use
        self._prefetch: ThreadPoolExecutor | None = None  # TCP loads' GETs, started on first use
        self._loaded_lock = threading.Lock()
        self._loaded: dict[str, set[int]] = {}  # async loads done: request -> failed blocks

    @property
    def enabled(self) -> bool:
        return self.sidecar is not None

    def register(self, kv_caches: dict[str, torch.Tensor], writers: dict[str, Any]) -> None:
        """Learn every layer's block layout; on failure the connector stays off (loads
        are then reported failed and recomputed, nothing is stored)."""
        caches, layouts = [], []
        try:
            for name, cache in kv_caches.items():
                write, heads, head_dim = writers[name]
                layouts.append(probe_layout(cache, write, heads, head_dim))
                caches.append(cache)
        except Exception:
            log.exception("cannot read this KV cache layout; the ctxcache connector is off")
            return
        first = layouts[0]
        if any(lay.tokens != first.tokens for lay in layouts) or self.block_size % first.tokens:
            log.error("layers with different block sizes; the ctxcache connector is off")
            return
        self.caches, self.layouts = caches, layouts
        shape = KVShape(len(caches), first.heads, first.head_dim, caches[0].dtype)
        self.shape = shape
        self.copier = BlockCopier(caches, layouts)
        self.sidecar = SidecarKV(
            kv_client_factory(self.config.sidecar_url, self.config.timeout_s),
            shape,
            max_pending=self.config.max_pending_stores,
            max_pending_bytes=self.config.max_pending_store_bytes,
            on_error=lambda op: self.counters.add("sidecar_errors"),
        )
        path = self._open_local()
        log.info(
            "ctxcache connector: %d layers, %d kv heads x %d, %s, %d-token kernel blocks; "
            "KV path %s",
            len(caches),
            first.heads,
            first.head_dim,
            caches[0].dtype,
            first.tokens,
            path,
        )

    def _open_local(self) -> str:
        """Use the local sidecar's shared memory when its socket is there; say which path."""
        where = self.config.local_dir
        if where is None:
            return f"tcp ({self.config.sidecar_url})"
        if not LocalClient.available(where):
            log.warning("ctxcache connector: no local sidecar socket in %s; using TCP", where)
            return f"tcp ({self.config.sidecar_url}; no socket in {where})"
        self.local = LocalClient(where, timeout=self.config.timeout_s)
        self.local.on_map.append(self._mapped)
        try:
            self.local.connect()
        except LocalError as exc:  # tried again at each load; TCP meanwhile
            log.warning("ctxcache connector: local sidecar not answering yet (%s)", exc)
        return f"shm ({where})"

    def _mapped(self, region: Region) -> None:
        """A (new) region is mapped: view it as bytes, and pin it for DMA on a GPU. The
        earlier one is let go once no copy on another thread uses it."""
        view = torch.frombuffer(region.map, dtype=torch.uint8)
        pinned = self.caches[0].is_cuda and register_host(view)
        with self._regions_lock:
            self._regions[region.generation] = (view, pinned)
            self._generation = region.generation
        self._let_go()

    def _use_region(self, region: Region | None) -> torch.Tensor:
        """The bytes of the region a lease is in, held until `_done_with_region`."""
        assert region is not None
        with self._regions_lock:
            if region.generation not in self._regions:  # (mapped before we listened)
                self._regions[region.generation] = (
                    torch.frombuffer(region.map, dtype=torch.uint8),
                    False,
                )
            gen = region.generation
            self._region_users[gen] = self._region_users.get(gen, 0) + 1
            return self._regions[gen][0]

    def _done_with_region(self, region: Region | None) -> None:
        assert region is not None
        with self._regions_lock:
            self._region_users[region.generation] -= 1
        self._let_go()

    def _let_go(self, everything: bool = False) -> None:
        """Unpin and drop the earlier sidecars' regions no copy uses (all, at close): the
        mapping itself goes with the last reference to it."""
        with self._regions_lock:
            gone = [
                gen
                for gen in self._regions
                if everything or (gen != self._generation and not self._region_users.get(gen))
            ]
            views = [self._regions.pop(gen) for gen in gone]
            for gen in gone:
                self._region_users.pop(gen, None)
        for view, pinned in views:
            if pinned:
                unregister_host(view)

    # -- loads ----------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        """This step's loads: carried out now, or with `async_loads` started (each is
        reported by `take_loaded` once whole, or failed)."""
        for spec in plan.loads:
            if self.config.async_loads:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="ctxcache-load")
                self._loader.submit(self._load_in_background, spec)
                continue
            t0 = time.perf_counter()
            self._invalid.update(self._carry_out(spec))
            self.counters.add("load_ms", round((time.perf_counter() - t0) * 1e3))

    def _carry_out(self, spec: LoadSpec) -> set[int]:
        """Load `spec`; the blocks it could not write (to be recomputed). Traced (the
        request's trace, `ctxcache.kv.load`): tokens planned and loaded, bytes per path."""
        self.counters.add("loads")
        planned = {"ctxcache.kv.planned_tokens": spec.end - spec.start}
        with tracing.span_in(spec.trace, "ctxcache.kv.load", planned):
            loaded = self._load(spec) if self.enabled else spec.start
            tracing.annotate({"ctxcache.kv.loaded_tokens": loaded - spec.start})
        self.counters.add("loaded_tokens", loaded - spec.start)
        if loaded >= spec.end:
            return set()
        self.counters.add("load_failures")
        return self._blocks_of(spec.block_ids, loaded, spec.end)

    def _load_in_background(self, spec: LoadSpec) -> None:
        """(On the loader thread.) The request is reported in every case: vLLM holds its
        blocks until it is."""
        t0 = time.perf_counter()
        try:
            failed = self._carry_out(spec)
        except Exception:
            log.exception("request %s: loading its KV failed; recomputing", spec.req_id)
            self.counters.add("load_failures")
            failed = self._blocks_of(spec.block_ids, spec.start, spec.end)
        self.counters.add("async_loads")
        self.counters.add("async_load_ms", round((time.perf_counter() - t0) * 1e3))
        with self._loaded_lock:
            self._loaded[spec.req_id] = failed

    def take_loaded(self) -> set[str]:
        """Requests whose async load is over since the last call; their failed blocks go
        to `take_invalid`, which vLLM calls after this in the same step."""
        with self._loaded_lock:
            done, self._loaded = self._loaded, {}
        for failed in done.values():
            self._invalid.update(failed)
        return set(done)

    def _load(self, spec: LoadSpec) -> int:
        """Write `spec`'s tokens; returns the first token not written."""
        pieces = [p for p in spec.pieces if min(spec.end, p.end) > max(spec.start, p.begin)]
        if self.local is not None:
            try:
                done, rest = self._load_local(spec, pieces)
            except LocalError as exc:
                self.counters.add("sidecar_errors")
                log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
            else:
                if not rest:
                    return done
                # blocks the region could not hold: the rest over lm:// (rare)
                return self._load_tcp(replace(spec, start=done), rest)
        return self._load_tcp(spec, pieces)

    def _load_local(self, spec: LoadSpec, pieces: list[Piece]) -> tuple[int, list[Piece]]:
        """One round trip leases the blocks; copies from the region; a release that says the
        lease held makes them good, else everything written here is recomputed. Returns the
        first token not written and the pieces to get over TCP instead (from a block the
        sidecar holds but could not place in the region)."""
        assert self.local is not None and self.copier is not None
        t0 = time.perf_counter()
        lease = self.local.lease([self.key(p.key) for p in pieces])
        if lease.region is None:
            return spec.start, []
        region = self._use_region(lease.region)
        try:
            return self._copy_leased(spec, pieces, lease, region, t0)
        finally:
            self._done_with_region(lease.region)

    def _copy_leased(
        self, spec: LoadSpec, pieces: list[Piece], lease: Lease, region: torch.Tensor, t0: float
    ) -> tuple[int, list[Piece]]:
        assert self.local is not None and self.copier is not None
        done, moved, rest = spec.start, 0, []
        batch: list[tuple[list[int], torch.Tensor, int, int]] = []  # engine-layout pieces
        for i, (piece, block) in enumerate(zip(pieces, lease.blocks, strict=True)):
            lo, hi = max(done, piece.begin), min(spec.end, piece.end)
            if block == TCP:
                rest = pieces[i:]
                break
            if not isinstance(block, Slot):
                break  # a miss: recomputed from here
            src = region[block.offset : block.offset + block.length]
            if not self._write_piece(spec, piece, block, src, lo, hi, batch):
                log.warning(
                    "request %s: block %s is not KV this engine reads; recomputing",
                    spec.req_id,
                    piece.key,
                )
                break
            done, moved = hi, moved + block.length
        self.copier.write_many(batch)
        self.copier.wait()
        if not self.local.release(lease):
            tracing.annotate({"ctxcache.kv.lease_race": True})
            self.counters.add("load_races")
            log.warning("request %s: the lease ended before the copy did; recomputing", spec.req_id)
            return spec.start, []
        self.counters.add("load_bytes_shm", moved)
        self.counters.add("load_us_shm", round((time.perf_counter() - t0) * 1e6))
        tracing.annotate({"ctxcache.kv.bytes_shm": moved, "ctxcache.kv.blocks_shm": len(batch)})
        return done, rest

    def _write_piece(
        self,
        spec: LoadSpec,
        piece: Piece,
        block: Slot,
        src: torch.Tensor,
        lo: int,
        hi: int,
        batch: list[tuple[list[int], torch.Tensor, int, int]],
    ) -> bool:
        """Write tokens [lo, hi) of `piece` from its payload `src` (a payload in the engine's
        layout: added to `batch`, written with the others); False if the payload is not one
        this engine can read (another layout, dtype or length)."""
        assert self.copier is not None
        shape = self.shape
        if block.dtype != shape.dtype_code:
            return False
        if block.fmt == FMT_ENGINE_BLOCKS:
            want = (len(self.caches), piece.length, self.copier.elems, self.copier.tag)
            if tuple(block.shape) != want or block.length != self.copier.nbytes(piece.length):
                return False
            # one id per payload block; those past `hi` are never touched (nor maybe allocated)
            ids = self._kernel_blocks(spec.block_ids, piece.begin, hi)
            ids += [-1] * (math.ceil(piece.length / self.copier.tokens) - len(ids))
            batch.append((ids, src, lo - piece.begin, hi - piece.begin))
            return True
        if block.fmt == FMT_KV_2LTD:
            if tuple(block.shape) != shape.wire_shape(piece.length):
                return False
            if block.length != piece.length * shape.bytes_per_token():
                return False
            kv = src.view(shape.dtype).view(
                2, shape.num_layers, piece.length, shape.num_kv_heads, shape.head_dim
            )
            self._write_2ltd(spec, piece, kv.permute(0, 1, 3, 2, 4), lo, hi)
            return True
        return False

    def _write_2ltd(self, spec: LoadSpec, piece: Piece, kv: torch.Tensor, lo: int, hi: int) -> None:
        """Tokens [lo, hi) of `piece` from its KV_2LTD payload `kv` (`[2, L, H, T, D]`):
        whole blocks as the engine lays them out, then row copies (`write_2ltd`); the
        indexed scatter where that does not apply (a piece that ends inside a block, CUDA)."""
        assert self.copier is not None
        n = self.copier.tokens
        if piece.begin % n == 0 and piece.length % n == 0:
            ids = self._kernel_blocks(spec.block_ids, piece.begin, hi)
            ids += [-1] * (piece.length // n - len(ids))  # past `hi`: never touched
            if self.copier.write_2ltd(ids, kv, lo - piece.begin, hi - piece.begin):
                return
        slots = token_slots(spec.block_ids, self.block_size, self.layouts[0].tokens, lo, hi)
        self.copier.scatter_2ltd(slots, kv[:, :, :, lo - piece.begin : hi - piece.begin])

    def _kernel_blocks(self, block_ids: list[int], begin: int, end: int) -> list[int]:
        return kernel_blocks(block_ids, self.block_size, self.layouts[0].tokens, begin, end)

    def _load_tcp(self, spec: LoadSpec, pieces: list[Piece]) -> int:
        """Its blocks come in one pipelined round trip; the writes stop at the first that is
        missing."""
        assert self.sidecar is not None
        t0 = time.perf_counter()
        sidecar = self.sidecar
        # the GETs of the next blocks arrive (one round trip per group, on the prefetch
        # thread) while this one is written: the socket and the scatter overlap
        groups = [pieces[i : i + _GET_GROUP] for i in range(0, len(pieces), _GET_GROUP)]
        if self._prefetch is None:
            self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="ctxcache-get")
        fetches = [
            self._prefetch.submit(sidecar.get_many, [(self.key(p.key), p.length) for p in group])
            for group in groups
        ]
        done, moved = spec.start, 0
        for piece, kv in self._arrivals(groups, fetches):
            lo, hi = max(done, piece.begin), min(spec.end, piece.end)
            if kv is None:
                for fetch in fetches:
                    fetch.cancel()
                log.warning(
                    "request %s: block %s gone or unreadable; recomputing", spec.req_id, piece.key
                )
                return done
            self._write_2ltd(spec, piece, kv, lo, hi)
            done = hi
            moved += kv.numel() * kv.element_size()
        self.counters.add("load_bytes_tcp", moved)
        self.counters.add("load_us_tcp", round((time.perf_counter() - t0) * 1e6))
        tracing.annotate({"ctxcache.kv.bytes_tcp": moved})
        return done

    @staticmethod
    def _arrivals(
        groups: list[list[Piece]], fetches: list[Future[list[torch.Tensor | None]]]
    ) -> Iterator[tuple[Piece, torch.Tensor | None]]:
        for group, fetch in zip(groups, fetches, strict=True):
            yield from zip(group, fetch.result(), strict=True)

    def key(self, key: str) -> str:
        """The scheduler's (rank 0) key for this worker's tensor-parallel rank."""
        if self.rank == 0:
            return key
        return replace(parse_key(key), worker_id=self.rank).to_string()

    def _blocks_of(self, block_ids: list[int], start: int, end: int) -> set[int]:
        first, last = start // self.block_size, (end - 1) // self.block_size
        return set(block_ids[first : last + 1])

    def take_invalid(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    # -- stores ---------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        for spec in plan.stores:
            t0 = time.perf_counter()
            tokens = {"ctxcache.kv.store_tokens": sum(p.length for p in spec.pieces)}
            try:
                with tracing.span_in(spec.trace, "ctxcache.kv.store", tokens):
                    saved = self.enabled and self._save(spec)
                    tracing.annotate({"ctxcache.kv.stored": saved})
                if not saved:
                    self.counters.add("store_drops")
            except Exception:
                self.counters.add("store_drops")
                log.exception("request %s: storing its KV failed", spec.req_id)
            finally:
                self._sent.add(spec.req_id)  # the copy is made (or given up): free the blocks
                self.counters.add("store_copy_ms", round((time.perf_counter() - t0) * 1e3))

    def _save(self, spec: StoreSpec) -> bool:
        if self.local is not None:
            try:
                if self._save_local(spec):
                    return True
            except LocalError as exc:
                self.counters.add("sidecar_errors")
                log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
        return self._save_tcp(spec)

    def _save_local(self, spec: StoreSpec) -> bool:
        """Copy the blocks into slots the sidecar allocated, then commit them (two round
        trips). False when the region is full (the caller stores over TCP)."""
        assert self.local is not None and self.copier is not None
        t0 = time.perf_counter()
        lease = self.local.alloc([self.copier.nbytes(p.length) for p in spec.pieces])
        if lease is None:
            self.counters.add("region_full")
            return False
        region = self._use_region(lease.region)
        try:
            self.copier.read_many(
                [
                    (
                        self._kernel_blocks(spec.block_ids, piece.begin, piece.end),
                        region[slot.offset : slot.offset + slot.length],
                    )
                    for piece, slot in zip(spec.pieces, lease.slots, strict=True)
                ]
            )
            self.copier.wait()
        except BaseException:
            self.local.abort(lease)  # nothing more is written: the slots can go back
            raise
        finally:
            self._done_with_region(lease.region)
        tag, elems, layers = self.copier.tag, self.copier.elems, len(self.caches)
        stored = self.local.commit(
            lease,
            [
                (
                    self.key(p.key),
                    FMT_ENGINE_BLOCKS,
                    self.shape.dtype_code,
                    (layers, p.length, elems, tag),
                )
                for p in spec.pieces
            ],
        )
        nbytes = sum(s.length for s in lease.slots)
        if stored < len(spec.pieces):  # not taken (the lease ended, the store refused)
            self.counters.add("store_failures_shm")
            log.warning(
                "request %s: the sidecar stored %d of %d blocks from shared memory; over TCP",
                spec.req_id,
                stored,
                len(spec.pieces),
            )
            return False
        self.counters.add("stored_blocks", stored)
        self.counters.add("stored_tokens", sum(p.length for p in spec.pieces))
        self.counters.add("store_bytes_shm", nbytes)
        self.counters.add("store_us_shm", round((time.perf_counter() - t0) * 1e6))
        tracing.annotate({"ctxcache.kv.bytes_shm": nbytes})
        return True

    def _save_tcp(self, spec: StoreSpec) -> bool:
        assert self.sidecar is not None
        t0 = time.perf_counter()
        lo = min(p.begin for p in spec.pieces)
        hi = max(p.end for p in spec.pieces)
        slots = token_slots(spec.block_ids, self.block_size, self.layouts[0].tokens, lo, hi)
        kv = gather(self.caches, self.layouts, slots).cpu()
        blocks = [(self.key(p.key), kv[:, :, :, p.begin - lo : p.end - lo]) for p in spec.pieces]
        if not self.sidecar.submit(StoreJob(blocks, spec.session)):
            return False
        self.counters.add("stored_blocks", len(blocks))
        self.counters.add("stored_tokens", sum(p.length for p in spec.pieces))
        self.counters.add("store_bytes_tcp", kv.numel() * kv.element_size())
        self.counters.add("store_us_tcp", round((time.perf_counter() - t0) * 1e6))
        tracing.annotate({"ctxcache.kv.bytes_tcp": kv.numel() * kv.element_size()})
        return True

    def take_sent(self) -> set[str]:
        out, self._sent = self._sent, set()
        return out

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True)
            self._prefetch = None
        if self.sidecar is not None:
            self.sidecar.close()
            self.sidecar = None
        if self.local is not None:
            self._let_go(everything=True)
            self.local.close()
            self.local = None


def cache_writer(
    layer: Any,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]:
    """The attention layer's own cache write (what its forward pass does), as a CacheWriter."""
    impl = layer.impl
    if not hasattr(impl, "do_kv_cache_update"):
        raise TypeError(f"{type(impl).__name__} has no do_kv_cache_update")

    def write(
        key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        impl.do_kv_cache_update(layer, key, value, cache, slots)

    return write


__all__ = ["CacheWriter", "WorkerSide", "cache_writer"]
