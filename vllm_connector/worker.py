"""The connector's worker half (`WorkerSide`): writes loaded blocks into vLLM's paged cache
before the forward pass and reads finished requests' blocks out of it for the sidecar.

It learns the cache's block layout (`register`), plans each step's loads onto their path
and reports them, and hands stores to their path. What it uses:
- `vllm_connector.loads`: a load's two data paths, shm (one lease per step for the sync
  loads) and tcp (docs/vllm.md, "KV paths");
- `vllm_connector.stores`: copying finished requests' blocks out, into the shared region
  or PUT over TCP;
- `vllm_connector.regions`: the local sidecar, found (also when it starts after vLLM)
  and its shared regions mapped and pinned;
- `vllm_connector.ordering`: the copies ordered after vLLM's compute stream, their handles.

By default loads are synchronous (the step's forward attends over them); with `async_loads`
they run on one background thread while the engine steps on, and a request whose load is
whole is reported in `take_loaded` (vLLM's `finished_recving`), with its failed blocks.
A block that is missing, unreadable or not the KV we store makes the rest of that load
fail: its vLLM blocks are reported to the scheduler (`get_block_ids_with_load_errors`; for
an async load in the same step as its request), which recomputes them — a miss, never a
wrong answer.

Failures are misses: anything a load raises (CUDA out of memory, a failed copy or
registration, a sidecar that answers nonsense) is caught per request, logged with its id
and counted (`load_errors`); its blocks from the first token not written are reported for
recompute and the lease it held goes back once no copy of it runs. A store that raises is
dropped (`store_errors`). Neither ever fails vLLM's step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from ctxcache import tracing
from ctxcache.lmcache_keys import parse_key
from sidecar.local_client import LocalClient
from vllm_connector import loads, ordering, stores
from vllm_connector.blockcopy import BlockCopier, kernel_blocks
from vllm_connector.config import ConnectorConfig
from vllm_connector.layout import BlockLayout, CacheWriter, probe_layout
from vllm_connector.loads import Job
from vllm_connector.ordering import CopyHandle
from vllm_connector.plan import LoadSpec, Piece
from vllm_connector.regions import Regions, find_local, open_local
from vllm_connector.scheduler import StepPlan
from vllm_connector.stats import Counters
from worker.kv.layout import KVShape
from worker.kv.sidecar import SidecarKV, kv_client_factory

log = logging.getLogger(__name__)

_STEP_KEYS = 4096  # keys in one shared lease at most (the sidecar's `MAX_KEYS`)


@dataclass
class _Loaded:
    """(async_loads) A load that is over on the host: reported once `handle` is done."""

    failed: set[int]
    handle: CopyHandle | None
    blocks: set[int]


def _groups(jobs: list[Job], pieces_of: Callable[[LoadSpec], list[Piece]]) -> Iterator[list[Job]]:
    """A step's sync loads in groups of at most `_STEP_KEYS` keys: one lease each."""
    group: list[Job] = []
    keys = 0
    for job in jobs:
        n = len(pieces_of(job.spec))
        if group and keys + n > _STEP_KEYS:
            yield group
            group, keys = [], 0
        group.append(job)
        keys += n
    if group:
        yield group


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
        self.regions = Regions()  # the local sidecars' regions, mapped and (CUDA) pinned
        self._sent: set[str] = set()
        self.storing: list[stores.Storing] = []  # stores whose copies run (CUDA): `settle`
        self._invalid: set[int] = set()
        self._loader: ThreadPoolExecutor | None = None  # (async_loads) started on first use
        self._prefetch: ThreadPoolExecutor | None = None  # TCP loads' GETs, started on first use
        self._loaded_lock = threading.Lock()
        self._loaded: dict[str, _Loaded] = {}  # (async) loads over on the host
        self.off: str | None = None  # why this worker cannot load or store (register failed)
        self.look_at: float | None = None  # (monotonic) when to look for the local socket again

    @property
    def enabled(self) -> bool:
        return self.sidecar is not None

    def turn_off(self, reason: str) -> None:
        """This worker carries out no load (each is a miss, reported at once) and no store;
        the connector tells the scheduler half, which then plans none."""
        self.off = reason
        log.error("ctxcache connector off on this worker: %s; KV is recomputed", reason)

    def register(self, kv_caches: dict[str, torch.Tensor], writers: dict[str, Any]) -> None:
        """Learn every layer's block layout; on failure the connector stays off (loads
        are then reported failed and recomputed, nothing is stored)."""
        caches, layouts = [], []
        try:
            for name, cache in kv_caches.items():
                write, heads, head_dim = writers[name]
                layouts.append(probe_layout(cache, write, heads, head_dim))
                caches.append(cache)
        except Exception as exc:
            log.exception("cannot read this KV cache layout")
            self.turn_off(f"its KV cache layout could not be read ({exc})")
            return
        if not layouts:
            self.turn_off("no KV cache layers were registered")
            return
        first = layouts[0]
        if any(lay.tokens != first.tokens for lay in layouts) or self.block_size % first.tokens:
            self.turn_off("its layers have different block sizes")
            return
        try:
            self._start(caches, layouts)
        except Exception as exc:
            log.exception("cannot start the ctxcache connector's copies")
            self.close()  # what it started (the storer, the local client) goes
            self.turn_off(f"its copies could not start ({exc})")

    def _start(self, caches: list[torch.Tensor], layouts: list[BlockLayout]) -> None:
        first = layouts[0]
        self.caches, self.layouts = caches, layouts
        shape = KVShape(len(caches), first.heads, first.head_dim, caches[0].dtype)
        self.shape = shape
        self.copier = BlockCopier(
            caches,
            layouts,
            ring_slots=self.config.ring_slots,
            slot_bytes=self.config.ring_slot_mib << 20,
        )
        self.regions.pin = caches[0].device if caches[0].is_cuda else None
        self.sidecar = SidecarKV(
            kv_client_factory(self.config.sidecar_url, self.config.timeout_s),
            shape,
            max_pending=self.config.max_pending_stores,
            max_pending_bytes=self.config.max_pending_store_bytes,
            on_error=lambda op: self.counters.add("sidecar_errors"),
        )
        path = open_local(self)
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

    # -- loads ----------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        """This step's loads: carried out now, or with `async_loads` started (each is
        reported by `take_loaded` once whole, or failed). On vLLM's model-runner thread:
        the event the copies wait on is recorded here, on the stream it computes on."""
        find_local(self)
        if not plan.loads:
            return
        try:
            after = ordering.compute_done(self.copier.device) if self.copier is not None else None
        except Exception as exc:  # a broken CUDA context: nothing of this step can load
            for spec in plan.loads:
                self._never_ran(Job(spec, written=spec.start), exc)
            return
        shared: list[Job] = []  # sync loads through shared memory: one lease for them all
        for spec in plan.loads:
            job = Job(spec, after, background=self.config.async_loads, written=spec.start)
            if not self.enabled:  # off: a miss, reported in this step
                self._loads_over(spec, self._carry_out(job))
                continue
            if self.config.async_loads:
                self._submit(job)
                continue
            if self.local is not None:
                shared.append(job)
                continue
            t0 = time.perf_counter()
            self._invalid.update(self._carry_out(job))
            self.counters.add("load_ms", round((time.perf_counter() - t0) * 1e3))
        if shared:
            t0 = time.perf_counter()
            for group in _groups(shared, self._pieces):
                self._invalid.update(loads.load_step(self, group))
            self.counters.add("load_ms", round((time.perf_counter() - t0) * 1e3))

    def _never_ran(self, job: Job, exc: BaseException) -> None:
        self.counters.add("loads")
        self.counters.add("load_failures")
        self._loads_over(job.spec, self._fail(job, exc))

    def _loads_over(self, spec: LoadSpec, failed: set[int]) -> None:
        """A load that never ran: its failed blocks reported as this step's (async: in
        `take_loaded`, which vLLM calls in this step too)."""
        if self.config.async_loads:
            with self._loaded_lock:
                self._loaded[spec.req_id] = _Loaded(failed, None, failed)
        else:
            self._invalid.update(failed)

    def _submit(self, job: Job) -> None:
        try:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="ctxcache-load")
            self._loader.submit(self._load_in_background, job)
        except Exception as exc:  # (the loader is shut down: the engine is closing)
            self._never_ran(job, exc)

    def _carry_out(self, job: Job) -> set[int]:
        """Load `job`'s spec; the blocks it could not write (to be recomputed). Anything it
        raises is a miss from the first token not written (`_fail`). Traced (the request's
        trace, `ctxcache.kv.load`): tokens planned and loaded, bytes per path."""
        spec = job.spec
        self.counters.add("loads")
        planned = {"ctxcache.kv.planned_tokens": spec.end - spec.start}
        with tracing.span_in(spec.trace, "ctxcache.kv.load", planned):
            if not self.enabled:
                loaded = spec.start
            else:
                try:
                    loaded = self._load(job)
                except Exception as exc:
                    self._fail(job, exc)
                    loaded = job.written
            tracing.annotate({"ctxcache.kv.loaded_tokens": loaded - spec.start})
        self.counters.add("loaded_tokens", loaded - spec.start)
        if loaded >= spec.end:
            return set()
        self.counters.add("load_failures")
        return self._blocks_of(spec.block_ids, loaded, spec.end)

    def _fail(self, job: Job, exc: BaseException) -> set[int]:
        """A load raised: logged with its request, counted (`load_errors`); no copy of it
        runs any more once this returns. The blocks from its first unwritten token."""
        spec = job.spec
        self.counters.add("load_errors")
        log.warning(
            "request %s: loading its KV failed (%s: %s); recomputing from token %d",
            spec.req_id,
            type(exc).__name__,
            exc,
            job.written,
            exc_info=not isinstance(exc, torch.OutOfMemoryError),
        )
        self._quiesce(spec.req_id)
        job.handle = None
        return self._blocks_of(spec.block_ids, job.written, spec.end)

    def _quiesce(self, req_id: str) -> bool:
        """Wait until no copy issued so far runs (the copier's and, on CUDA, the calling
        thread's stream); False if that cannot be known (a broken CUDA context)."""
        if self.copier is None:
            return True
        try:
            self.copier.wait()
            if self.copier.device.type == "cuda":
                torch.cuda.current_stream(self.copier.device).synchronize()
        except Exception:
            log.exception("request %s: cannot wait for its copies", req_id)
            return False
        return True

    def _load_in_background(self, job: Job) -> None:
        """(On the loader thread.) The request is reported in every case: vLLM holds its
        blocks until it is; with copies in flight, once they are done (`take_loaded`)."""
        spec = job.spec
        t0 = time.perf_counter()
        try:
            failed = self._carry_out(job)
        except Exception:
            log.exception("request %s: loading its KV failed; recomputing", spec.req_id)
            self.counters.add("load_failures")
            failed = self._blocks_of(spec.block_ids, spec.start, spec.end)
            job.handle = None
        self.counters.add("async_loads")
        self.counters.add("async_load_ms", round((time.perf_counter() - t0) * 1e3))
        blocks = self._blocks_of(spec.block_ids, spec.start, spec.end)
        with self._loaded_lock:
            self._loaded[spec.req_id] = _Loaded(failed, job.handle, blocks)

    def take_loaded(self) -> set[str]:
        """Requests whose async load is over since the last call, its copies done on the
        device (polled: never a host wait); their failed blocks go to `take_invalid`, which
        vLLM calls after this in the same step."""
        ready: dict[str, set[int]] = {}
        with self._loaded_lock:
            for rid, over in list(self._loaded.items()):
                failed = self._settled(rid, over)
                if failed is not None:
                    ready[rid] = failed
                    del self._loaded[rid]
        for failed in ready.values():
            self._invalid.update(failed)
        return set(ready)

    def _settled(self, rid: str, over: _Loaded) -> set[int] | None:
        """`over`'s failed blocks once its copies are done, else None (asked again next
        step); a handle that cannot say fails the whole load."""
        if over.handle is None:
            return over.failed
        try:
            if not over.handle.done():
                return None
        except Exception:
            log.exception("request %s: its KV copies failed; recomputing", rid)
            self.counters.add("load_errors")
            self.counters.add("load_failures")
            self._quiesce(rid)
            return over.blocks
        return over.failed

    def _load(self, job: Job) -> int:
        """Write `job`'s tokens; returns the first token not written (`job.written` follows
        it, for `_fail`)."""
        spec = job.spec
        pieces = self._pieces(spec)
        if not job.background:
            return loads.load_paths(self, job, spec, pieces)
        # the loader thread's stream is not vLLM's: its kernels (a KV_2LTD piece's
        # scatter) wait for the step's event, and the load is over when they are
        assert self.copier is not None
        ordering.order_after(self.copier.device, job.after)
        done = loads.load_paths(self, job, spec, pieces)
        if self.copier.device.type == "cuda":
            job.handle = ordering.EventDone(ordering.record_event(self.copier.device))
        return done

    @staticmethod
    def _pieces(spec: LoadSpec) -> list[Piece]:
        """The pieces with tokens of [start, end) in them."""
        return [p for p in spec.pieces if min(spec.end, p.end) > max(spec.start, p.begin)]

    def _kernel_blocks(self, block_ids: list[int], begin: int, end: int) -> list[int]:
        return kernel_blocks(block_ids, self.block_size, self.layouts[0].tokens, begin, end)

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
        """Copy the finished requests' blocks out (`stores.save`: on vLLM's model-runner
        thread, after the forward pass). Never raises: a store that fails is dropped,
        counted and logged."""
        find_local(self)
        stores.save(self, plan)

    def take_sent(self) -> set[str]:
        """Requests whose stores are over: committed (their copies done) or dropped."""
        stores.settle(self)
        out, self._sent = self._sent, set()
        return out

    def close(self) -> None:
        stores.settle(self, wait=True)
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True)
            self._prefetch = None
        if self.sidecar is not None:
            self.sidecar.close()
            self.sidecar = None
        self.regions.close()
        if self.local is not None:
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
