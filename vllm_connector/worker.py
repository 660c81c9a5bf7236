"""The connector's worker half (`WorkerSide`): writes loaded blocks into vLLM's paged cache
before the forward pass and reads finished requests' blocks out of it for the sidecar.

It learns the cache's block layout (`register`), then hands each step's loads and stores
to a KV path (`vllm_connector.paths.KVPath`) and reports them. The paths (docs/vllm.md,
"KV paths"):
- `vllm_connector.shm_path.ShmPath`: the local sidecar's shared memory (one lease per step
  for the sync loads), when its socket is in `local_dir` (`vllm_connector.regions`: the
  socket found, also when the sidecar starts after vLLM, and its regions mapped and
  pinned);
- `vllm_connector.tcp_path.TcpPath`: `lm://`, a remote sidecar or what shared memory
  cannot serve.
Both write through one `vllm_connector.paged.PagedKV` (the registered cache, its copier)
and account for each load with one `vllm_connector.loads.LoadRunner`; their copies are
ordered after vLLM's compute stream (`vllm_connector.ordering`).

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ctxcache import tracing
from sidecar.local_client import LocalClient
from vllm_connector import ordering
from vllm_connector.blockcopy import BlockCopier
from vllm_connector.config import ConnectorConfig
from vllm_connector.layout import BlockLayout, CacheWriter, probe_layout
from vllm_connector.loads import Job, LoadRunner
from vllm_connector.mla import probe_latent_layout
from vllm_connector.ordering import CopyHandle
from vllm_connector.paged import PagedKV, rank_key
from vllm_connector.paths import KVPath
from vllm_connector.plan import LoadSpec
from vllm_connector.regions import LocalSocket, Regions
from vllm_connector.scheduler import StepPlan
from vllm_connector.shm_path import ShmPath
from vllm_connector.stats import Counters
from vllm_connector.stores import Storing, dropped
from vllm_connector.tcp_path import TcpPath
from worker.kv.sidecar import SidecarKV, kv_client_factory

log = logging.getLogger(__name__)


@dataclass
class _Loaded:
    """(async_loads) A load that is over on the host: reported once `handle` is done."""

    failed: set[int]
    handle: CopyHandle | None
    blocks: set[int]


class WorkerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        block_size: int,
        rank: int = 0,
        counters: Counters | None = None,
        *,
        latent: bool = False,
    ) -> None:
        self.config = config
        self.block_size = block_size
        # An MLA model's latent (`latent`, vllm_connector.mla) is the same on every rank:
        # one set of keys, stored by rank 0 only; every rank loads it.
        self.latent = latent
        self.rank = 0 if latent else rank  # the rank its keys name
        self.stores = rank == 0 or not latent
        self.counters = counters if counters is not None else Counters()
        self.regions = Regions()  # the local sidecars' regions, mapped and (CUDA) pinned
        self.socket = LocalSocket(config, self.regions)
        self.kv: PagedKV | None = None  # the registered cache and its copier
        self.runner = LoadRunner(self.counters, block_size)  # (with `kv` once registered)
        self.tcp: TcpPath | None = None  # lm://: every load and store, or what shm cannot
        self.shm: ShmPath | None = None  # the local sidecar's shared memory, when found
        self._sent: set[str] = set()
        self._invalid: set[int] = set()
        self._loader: ThreadPoolExecutor | None = None  # (async_loads) started on first use
        self._loaded_lock = threading.Lock()
        self._loaded: dict[str, _Loaded] = {}  # (async) loads over on the host
        self.off: str | None = None  # why this worker cannot load or store (register failed)

    @property
    def enabled(self) -> bool:
        return self.tcp is not None

    # what the paths use, as the benchmarks and tests look at it
    @property
    def caches(self) -> list[torch.Tensor]:
        return self.kv.caches if self.kv is not None else []

    @property
    def layouts(self) -> list[BlockLayout]:
        return self.kv.layouts if self.kv is not None else []

    @property
    def copier(self) -> BlockCopier | None:
        return self.kv.copier if self.kv is not None else None

    @property
    def sidecar(self) -> SidecarKV | None:
        return self.tcp.sidecar if self.tcp is not None else None

    @property
    def local(self) -> LocalClient | None:
        return self.shm.local if self.shm is not None else None

    def turn_off(self, reason: str) -> None:
        """This worker carries out no load (each is a miss, reported at once) and no store;
        the connector tells the scheduler half, which then plans none."""
        self.off = reason
        log.error("ctxcache connector off on this worker: %s; KV is recomputed", reason)

    def register(self, kv_caches: dict[str, torch.Tensor], writers: dict[str, Any]) -> None:
        """Learn every layer's block layout; on failure the connector stays off (loads
        are then reported failed and recomputed, nothing is stored)."""
        caches, layouts = [], []
        probe = probe_latent_layout if self.latent else probe_layout
        try:
            for name, cache in kv_caches.items():
                write, heads, head_dim = writers[name]
                layouts.append(probe(cache, write, heads, head_dim))
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
        copier = BlockCopier(
            caches,
            layouts,
            ring_slots=self.config.ring_slots,
            slot_bytes=self.config.ring_slot_mib << 20,
        )
        kv = self.kv = PagedKV(caches, layouts, copier, self.block_size, self.rank)
        self.runner = LoadRunner(self.counters, self.block_size, kv)
        self.regions.pin = caches[0].device if caches[0].is_cuda else None
        sidecar = SidecarKV(
            kv_client_factory(self.config.sidecar_url, self.config.timeout_s),
            kv.shape,
            max_pending=self.config.max_pending_stores,
            max_pending_bytes=self.config.max_pending_store_bytes,
            on_error=lambda op: self.counters.add("sidecar_errors"),
        )
        self.tcp = TcpPath(kv, sidecar, self.runner, self.counters)
        local, path = self.socket.open()
        self._use_local(local)
        what = (
            f"an MLA latent of {first.head_dim} channels ({'stored' if self.stores else 'loaded'}"
            " here; rank 0 stores it for every rank)"
            if self.latent
            else f"{first.heads} kv heads x {first.head_dim}"
        )
        log.info(
            "ctxcache connector: %d layers, %s, %s, %d-token kernel blocks; KV path %s",
            len(caches),
            what,
            caches[0].dtype,
            first.tokens,
            path,
        )

    def _use_local(self, local: LocalClient | None) -> None:
        """Loads and stores take shared memory from now on (a loader thread reads `shm`
        as None or the path, never in between)."""
        if local is None or self.kv is None or self.tcp is None:
            return
        self.shm = ShmPath(self.kv, local, self.regions, self.tcp, self.runner, self.counters)

    def _find_local(self) -> None:
        """(On the model-runner thread: `load`, `save`.) While on TCP for want of the
        local sidecar's socket, look for it again (`LocalSocket.appeared`)."""
        if self.enabled and self.shm is None:
            self._use_local(self.socket.appeared())

    def _path(self) -> KVPath | None:
        """The path a job takes now: shared memory when the local sidecar is known, else
        lm://; None when this worker is off."""
        return self.shm if self.shm is not None else self.tcp

    # -- loads ----------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        """This step's loads: carried out now, or with `async_loads` started (each is
        reported by `take_loaded` once whole, or failed). On vLLM's model-runner thread:
        the event the copies wait on is recorded here, on the stream it computes on."""
        self._find_local()
        if not plan.loads:
            return
        try:
            after = ordering.compute_done(self.kv.copier.device) if self.kv is not None else None
        except Exception as exc:  # a broken CUDA context: nothing of this step can load
            for spec in plan.loads:
                self._loads_over(spec, self.runner.never_ran(Job(spec, written=spec.start), exc))
            return
        path = self._path()
        sync: list[Job] = []  # one call of the path for them all (shm: one lease)
        for spec in plan.loads:
            job = Job(spec, after, background=self.config.async_loads, written=spec.start)
            if path is None:  # off: a miss, reported in this step
                self._loads_over(spec, self.runner.carry_out(job, None))
            elif self.config.async_loads:
                self._submit(path, job)
            else:
                sync.append(job)
        if path is not None and sync:
            t0 = time.perf_counter()
            self._invalid.update(path.load(sync))
            self.counters.add("load_ms", round((time.perf_counter() - t0) * 1e3))

    def _loads_over(self, spec: LoadSpec, failed: set[int]) -> None:
        """A load that never ran: its failed blocks reported as this step's (async: in
        `take_loaded`, which vLLM calls in this step too)."""
        if self.config.async_loads:
            with self._loaded_lock:
                self._loaded[spec.req_id] = _Loaded(failed, None, failed)
        else:
            self._invalid.update(failed)

    def _submit(self, path: KVPath, job: Job) -> None:
        try:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="ctxcache-load")
            self._loader.submit(self._load_in_background, path, job)
        except Exception as exc:  # (the loader is shut down: the engine is closing)
            self._loads_over(job.spec, self.runner.never_ran(job, exc))

    def _load_in_background(self, path: KVPath, job: Job) -> None:
        """(On the loader thread.) The request is reported in every case: vLLM holds its
        blocks until it is; with copies in flight, once they are done (`take_loaded`)."""
        spec = job.spec
        t0 = time.perf_counter()
        try:
            failed = path.load([job])
        except Exception:
            log.exception("request %s: loading its KV failed; recomputing", spec.req_id)
            self.counters.add("load_failures")
            failed = self.runner.blocks(spec)
            job.handle = None
        self.counters.add("async_loads")
        self.counters.add("async_load_ms", round((time.perf_counter() - t0) * 1e3))
        blocks = self.runner.blocks(spec)
        with self._loaded_lock:
            self._loaded[spec.req_id] = _Loaded(failed, job.handle, blocks)

    def take_loaded(self) -> set[str]:
        """Requests whose async load is over since the last call, its copies done on the
        device (polled: never a host wait); their failed blocks go to `take_invalid`, which
        vLLM calls after this in the same step."""
        ready = self.take_loaded_blocks()
        for failed in ready.values():
            self._invalid.update(failed)
        return set(ready)

    def take_loaded_blocks(self) -> dict[str, set[int]]:
        """`take_loaded`'s requests, each with its failed blocks (kept out of
        `take_invalid`: a hybrid model's worker reports a failed request instead)."""
        ready: dict[str, set[int]] = {}
        with self._loaded_lock:
            for rid, over in list(self._loaded.items()):
                failed = self._settled(rid, over)
                if failed is not None:
                    ready[rid] = failed
                    del self._loaded[rid]
        return ready

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
            self.runner.quiesce(rid)
            return over.blocks
        return over.failed

    def key(self, key: str) -> str:
        """The scheduler's (rank 0) key for this worker's tensor-parallel rank."""
        return rank_key(key, self.rank)

    def take_invalid(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    # -- stores ---------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        """Copy the finished requests' blocks out (on vLLM's model-runner thread, after the
        forward pass: the copies wait for an event recorded here on its stream). Never
        raises: a store that fails is dropped, counted and logged."""
        self._find_local()
        if not plan.stores:
            return
        if not self.stores:  # (MLA, rank > 0) rank 0 stores the latent all ranks hold
            self._sent.update(spec.req_id for spec in plan.stores)
            self.counters.add("stores_left_to_rank0", len(plan.stores))
            return
        path = self._path()
        after = None
        if path is not None and self.kv is not None:
            try:
                after = ordering.compute_done(self.kv.copier.device)
            except Exception:
                log.exception("cannot order this step's stores after its compute; dropped")
                self.counters.add("store_errors", len(plan.stores))
                self.counters.add("store_drops", len(plan.stores))
                self._sent.update(spec.req_id for spec in plan.stores)
                return
        for spec in plan.stores:
            t0 = time.perf_counter()
            tokens = {"ctxcache.kv.store_tokens": sum(p.length for p in spec.pieces)}
            saved: bool | Storing = False
            try:
                with tracing.span_in(spec.trace, "ctxcache.kv.store", tokens):
                    saved = path is not None and path.store(spec, after)
                    tracing.annotate({"ctxcache.kv.stored": saved is not False})
                if not saved:
                    self.counters.add("store_drops")
            except Exception as exc:
                dropped(self.counters, spec, exc)
            finally:
                if not isinstance(saved, Storing):  # (else held until it is committed)
                    self._sent.add(spec.req_id)  # the copy is made (or given up): free them
                self.counters.add("store_copy_ms", round((time.perf_counter() - t0) * 1e3))

    def settle(self, *, wait: bool = False) -> None:
        """Commit the stores whose copies are done (all, with `wait`); their requests are
        then reported by `take_sent`. Never raises."""
        if self.shm is not None:
            self._sent |= self.shm.settle(wait=wait)

    def take_sent(self) -> set[str]:
        """Requests whose stores are over: committed (their copies done) or dropped."""
        self.settle()
        out, self._sent = self._sent, set()
        return out

    def close(self) -> None:
        self.settle(wait=True)
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None
        self.regions.close()
        if self.shm is not None:
            self.shm.close()
            self.shm = None


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
