"""The connector's worker half: writes loaded blocks into vLLM's paged cache before the
forward pass and reads finished requests' blocks out of it for the sidecar.

A load's blocks come in one pipelined round trip of GETs, then one scatter per layer each.
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
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from ctxcache.lmcache_keys import parse_key
from vllm_connector.config import ConnectorConfig
from vllm_connector.layout import (
    BlockLayout,
    CacheWriter,
    gather,
    probe_layout,
    scatter,
    token_slots,
)
from vllm_connector.plan import LoadSpec, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.stats import Counters
from worker.kv.layout import KVShape
from worker.kv.sidecar import SidecarKV, StoreJob, kv_client_factory

log = logging.getLogger(__name__)


class WorkerSide:
    def __init__(self, config: ConnectorConfig, block_size: int, rank: int = 0) -> None:
        self.config = config
        self.block_size = block_size
        self.rank = rank
        self.counters = Counters()
        self.caches: list[torch.Tensor] = []
        self.layouts: list[BlockLayout] = []
        self.sidecar: SidecarKV | None = None
        self._sent: set[str] = set()
        self._invalid: set[int] = set()
        self._loader: ThreadPoolExecutor | None = None  # (async_loads) started on first use
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
        self.sidecar = SidecarKV(
            kv_client_factory(self.config.sidecar_url, self.config.timeout_s),
            shape,
            max_pending=self.config.max_pending_stores,
            max_pending_bytes=self.config.max_pending_store_bytes,
            on_error=lambda op: self.counters.add("sidecar_errors"),
        )
        log.info(
            "ctxcache connector: %d layers, %d kv heads x %d, %s, %d-token kernel blocks",
            len(caches),
            first.heads,
            first.head_dim,
            caches[0].dtype,
            first.tokens,
        )

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
        """Load `spec`; the blocks it could not write (to be recomputed)."""
        loaded = self._load(spec) if self.enabled else spec.start
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
        """Write `spec`'s tokens; returns the first token not written. Its blocks come in
        one pipelined round trip; the writes stop at the first that is missing."""
        assert self.sidecar is not None
        pieces = [p for p in spec.pieces if min(spec.end, p.end) > max(spec.start, p.begin)]
        kvs = self.sidecar.get_many([(self.key(p.key), p.length) for p in pieces])
        done = spec.start
        for piece, kv in zip(pieces, kvs, strict=True):
            lo, hi = max(done, piece.begin), min(spec.end, piece.end)
            if kv is None:
                log.warning(
                    "request %s: block %s gone or unreadable; recomputing", spec.req_id, piece.key
                )
                return done
            slots = token_slots(spec.block_ids, self.block_size, self.layouts[0].tokens, lo, hi)
            scatter(
                self.caches, self.layouts, slots, kv[:, :, :, lo - piece.begin : hi - piece.begin]
            )
            done = hi
        return done

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
            try:
                if not self.enabled or not self._save(spec):
                    self.counters.add("store_drops")
            except Exception:
                self.counters.add("store_drops")
                log.exception("request %s: storing its KV failed", spec.req_id)
            finally:
                self._sent.add(spec.req_id)  # the copy is made (or given up): free the blocks
                self.counters.add("store_copy_ms", round((time.perf_counter() - t0) * 1e3))

    def _save(self, spec: StoreSpec) -> bool:
        assert self.sidecar is not None
        lo = min(p.begin for p in spec.pieces)
        hi = max(p.end for p in spec.pieces)
        slots = token_slots(spec.block_ids, self.block_size, self.layouts[0].tokens, lo, hi)
        kv = gather(self.caches, self.layouts, slots).cpu()
        blocks = [(self.key(p.key), kv[:, :, :, p.begin - lo : p.end - lo]) for p in spec.pieces]
        if not self.sidecar.submit(StoreJob(blocks, spec.session)):
            return False
        self.counters.add("stored_blocks", len(blocks))
        self.counters.add("stored_tokens", sum(p.length for p in spec.pieces))
        return True

    def take_sent(self) -> set[str]:
        out, self._sent = self._sent, set()
        return out

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self.sidecar is not None:
            self.sidecar.close()
            self.sidecar = None


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
