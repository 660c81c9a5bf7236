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

Failures are misses: anything a load raises (CUDA out of memory, a failed copy or
registration, a sidecar that answers nonsense) is caught per request, logged with its id
and counted (`load_errors`); its blocks from the first token not written are reported for
recompute and the lease it held goes back once no copy of it runs. A store that raises is
dropped (`store_errors`). Neither ever fails vLLM's step.

Ordering (CUDA): the copies wait for an event recorded on the stream vLLM computes on, read
on the thread that calls `load`/`save` (vLLM's model-runner thread: `compute_done`), never
on the loader thread; an async load carries the event of the step that submitted it. A
sync load waits on the host for its copies before its release (the release is what says
the lease held through them); an async load is reported in `take_loaded` only once its
copies' handle is `done()`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

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
_POLL_S = 0.0002  # how often the loader thread asks whether its copies are done
_PIN_JOIN_S = 30.0  # how long `close` waits for a region's pinning to finish
_STEP_KEYS = 4096  # keys in one shared lease at most (the sidecar's `MAX_KEYS`)


def compute_done(device: torch.device) -> Any:
    """An event recorded on the stream the calling thread computes on (its current stream:
    on vLLM's model-runner thread, the forward pass's), for the copies to wait on; None on
    CPU, where copies are synchronous. The ordering seam: tests replace it."""
    if device.type != "cuda":
        return None
    return _record_event(device)


def _record_event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class CopyHandle(Protocol):
    """What the copier's `write_many`/`read_many` return (vllm_connector.blockcopy)."""

    event: Any

    def done(self) -> bool: ...

    def wait(self) -> None: ...


class _EventDone:
    """Copies issued on a CUDA stream: complete when `event` is."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


@dataclass
class _Job:
    """One load being carried out: the compute stream's event its copies wait on, whether it
    runs on the loader thread, the first token not (known to be) written, and (async) the
    handle of copies still in flight when it returns."""

    spec: LoadSpec
    after: Any = None
    background: bool = False
    written: int = 0
    handle: CopyHandle | None = None


@dataclass
class _Loaded:
    """(async_loads) A load that is over on the host: reported once `handle` is done."""

    failed: set[int]
    handle: CopyHandle | None
    blocks: set[int]


@dataclass
class _Part:
    """One request's part of a step's shared lease (`WorkerSide._load_step`): its span,
    open until the shared release; what its copies from the region wrote (vouched for
    only by that release) and everything it wrote (a TCP rest too); what it read."""

    job: _Job
    pieces: list[Piece]
    span: Any = None
    shm_done: int = 0
    loaded: int = 0
    moved: int = 0
    blocks: int = 0
    raised: bool = False


def _groups(jobs: list[_Job], pieces_of: Callable[[LoadSpec], list[Piece]]) -> Iterator[list[_Job]]:
    """A step's sync loads in groups of at most `_STEP_KEYS` keys: one lease each."""
    group: list[_Job] = []
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
        self._loaded: dict[str, _Loaded] = {}  # (async) loads over on the host
        self.off: str | None = None  # why this worker cannot load or store (register failed)
        self._pin_regions = False  # (CUDA) pin each mapped region, on its own thread
        self._pinning: list[threading.Thread] = []

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
        self._pin_regions = caches[0].is_cuda
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
        self.local = LocalClient(
            where, timeout=self.config.timeout_s, defer_releases=self.config.shm_deferred_release
        )
        self.local.on_map.append(self._mapped)
        try:
            self.local.connect()
        except LocalError as exc:  # tried again at each load; TCP meanwhile
            log.warning("ctxcache connector: local sidecar not answering yet (%s)", exc)
        return f"shm ({where})"

    def _mapped(self, region: Region) -> None:
        """A (new) region is mapped: view it as bytes, and on a GPU pin it for DMA on a
        thread of its own (`cudaHostRegister` of a large region takes seconds: the load
        that noticed the new region, and those after it, copy from it unpinned meanwhile,
        slower but correct). The earlier one is let go once no copy uses it."""
        view = torch.frombuffer(region.map, dtype=torch.uint8)
        with self._regions_lock:
            self._regions[region.generation] = (view, False)
            self._generation = region.generation
        self._let_go()
        if self._pin_regions:
            pin = threading.Thread(
                target=self._pin,
                args=(region.generation, view),
                name="ctxcache-pin",
                daemon=True,
            )
            self._pinning = [t for t in self._pinning if t.is_alive()] + [pin]
            pin.start()

    def _pin(self, generation: str, view: torch.Tensor) -> None:
        """(On its own thread.) Pin a region; a failure leaves it pageable (a log line). A
        region let go while it was being pinned is unpinned here."""
        t0 = time.perf_counter()
        try:
            pinned = register_host(view)
        except Exception:
            log.exception("pinning the shared region failed; copies from it stay pageable")
            return
        if not pinned:
            log.warning("the shared region (%s) stays pageable: slower copies", generation)
            return
        with self._regions_lock:
            entry = self._regions.get(generation)
            kept = entry is not None and entry[0] is view
            if kept:
                self._regions[generation] = (view, True)
        if not kept:
            self._unpin(view)
            return
        log.info(
            "pinned the shared region (%s, %d MiB) in %.1f s",
            generation,
            view.numel() >> 20,
            time.perf_counter() - t0,
        )

    @staticmethod
    def _unpin(view: torch.Tensor) -> None:
        try:
            unregister_host(view)
        except Exception:
            log.exception("unpinning a shared region failed")

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
                self._unpin(view)

    # -- loads ----------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        """This step's loads: carried out now, or with `async_loads` started (each is
        reported by `take_loaded` once whole, or failed). On vLLM's model-runner thread:
        the event the copies wait on is recorded here, on the stream it computes on."""
        if not plan.loads:
            return
        try:
            after = compute_done(self.copier.device) if self.copier is not None else None
        except Exception as exc:  # a broken CUDA context: nothing of this step can load
            for spec in plan.loads:
                self._never_ran(_Job(spec, written=spec.start), exc)
            return
        shared: list[_Job] = []  # sync loads through shared memory: one lease for them all
        for spec in plan.loads:
            job = _Job(spec, after, background=self.config.async_loads, written=spec.start)
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
                self._invalid.update(self._load_step(group))
            self.counters.add("load_ms", round((time.perf_counter() - t0) * 1e3))

    def _never_ran(self, job: _Job, exc: BaseException) -> None:
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

    def _submit(self, job: _Job) -> None:
        try:
            if self._loader is None:
                self._loader = ThreadPoolExecutor(1, thread_name_prefix="ctxcache-load")
            self._loader.submit(self._load_in_background, job)
        except Exception as exc:  # (the loader is shut down: the engine is closing)
            self._never_ran(job, exc)

    def _carry_out(self, job: _Job) -> set[int]:
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

    def _fail(self, job: _Job, exc: BaseException) -> set[int]:
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

    def _load_in_background(self, job: _Job) -> None:
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

    def _load(self, job: _Job) -> int:
        """Write `job`'s tokens; returns the first token not written (`job.written` follows
        it, for `_fail`)."""
        spec = job.spec
        pieces = self._pieces(spec)
        if not job.background:
            return self._load_paths(job, spec, pieces)
        # the loader thread's stream is not vLLM's: its kernels (a KV_2LTD piece's
        # scatter) wait for the step's event, and the load is over when they are
        self._order_after(job.after)
        done = self._load_paths(job, spec, pieces)
        assert self.copier is not None
        if self.copier.device.type == "cuda":
            job.handle = _EventDone(_record_event(self.copier.device))
        return done

    @staticmethod
    def _pieces(spec: LoadSpec) -> list[Piece]:
        """The pieces with tokens of [start, end) in them."""
        return [p for p in spec.pieces if min(spec.end, p.end) > max(spec.start, p.begin)]

    def _load_step(self, jobs: list[_Job]) -> set[int]:
        """Sync loads of one step through shared memory: one lease for all their blocks
        (one round trip), each request's copies, one release of it all — trusted at once
        when the lease is valid beyond doubt (`LocalClient.release`: no round trip; the
        release rides on the next request). A release that says the lease did not hold
        makes every load that read under it a miss. Each request keeps its own span
        (`ctxcache.kv.load`, open until the release; the shared lease's round trip is the
        first one's child and is annotated on each) and its own counts, as `_carry_out`
        keeps them. Returns the blocks to recompute; never raises."""
        assert self.local is not None
        parts = [_Part(job, self._pieces(job.spec)) for job in jobs]
        t0 = time.perf_counter()
        lease: Lease | None = None
        error: Exception | None = None
        region: torch.Tensor | None = None
        step: dict[str, Any] = {"ctxcache.kv.step_loads": len(parts)}
        with contextlib.ExitStack() as open_spans:
            for n, part in enumerate(parts):
                spec = part.job.spec
                self.counters.add("loads")
                planned = {"ctxcache.kv.planned_tokens": spec.end - spec.start}
                span = tracing.span_in(spec.trace, "ctxcache.kv.load", planned)
                part.span = open_spans.enter_context(span)
                part.shm_done = part.loaded = spec.start
                if n == 0:
                    lease, error = self._step_lease(parts, step)
                    if lease is not None and lease.region is not None:
                        region = self._use_region(lease.region)
                        open_spans.callback(self._done_with_region, lease.region)
                blocks: Sequence[Slot | str | None] = []
                if lease is not None:
                    first = sum(len(p.pieces) for p in parts[:n])
                    blocks = lease.blocks[first : first + len(part.pieces)]
                self._step_part(part, lease, region, blocks, error)
            held = True
            if lease is not None and lease.id:
                raised = any(p.raised for p in parts)  # then wait for the answer
                held = (
                    self.local.release(lease, defer=False) if raised else self.local.release(lease)
                )
            failed: set[int] = set()
            for part in parts:
                failed |= self._step_over(part, held, step)
        moved = sum(p.moved for p in parts)
        if held and moved:
            self.counters.add("load_us_shm", round((time.perf_counter() - t0) * 1e6))
        return failed

    def _step_lease(
        self, parts: list[_Part], step: dict[str, Any]
    ) -> tuple[Lease | None, Exception | None]:
        """The step's one lease (in the first request's span). No lease: the local sidecar
        failed (every load goes over TCP), or the error that every load fails with (a
        sidecar that answers nonsense, a key this worker cannot name: a miss each)."""
        assert self.local is not None
        t0 = time.perf_counter()
        ids = ", ".join(p.job.spec.req_id for p in parts)
        try:
            keys = [self.key(p.key) for part in parts for p in part.pieces]
            lease = self.local.lease(keys)
        except LocalError as exc:
            self.counters.add("sidecar_errors")
            log.warning("requests %s: local sidecar failed (%s); over TCP", ids, exc)
            return None, None
        except Exception as exc:
            return None, exc
        step["ctxcache.kv.step_lease_us"] = round((time.perf_counter() - t0) * 1e6)
        step["ctxcache.kv.step_lease_keys"] = len(keys)
        return lease, None

    def _step_part(
        self,
        part: _Part,
        lease: Lease | None,
        region: torch.Tensor | None,
        blocks: Sequence[Slot | str | None],
        error: Exception | None = None,
    ) -> None:
        """One request's copies under the step's lease (its TCP rest after them); a
        failure (`error`: the lease's) is logged and counted (`_fail`) and leaves what the
        part wrote."""
        job, spec = part.job, part.job.spec
        try:
            if error is not None:
                raise error
            if lease is None:
                part.loaded = self._load_tcp(job, spec, part.pieces)
                return
            if region is None:
                return
            done, part.moved, rest, part.blocks = self._copy_blocks(
                job, part.pieces, blocks, region
            )
            part.shm_done = part.loaded = job.written = done
            if rest:  # blocks the region could not hold: the rest over lm:// (rare)
                part.loaded = self._load_tcp(job, replace(spec, start=done), rest)
        except Exception as exc:
            part.raised = True
            self._fail(job, exc)
            part.loaded = job.written

    def _step_over(self, part: _Part, held: bool, step: dict[str, Any]) -> set[int]:
        """A part's outcome once the step's lease is released: counted and annotated on
        its span; its blocks to recompute."""
        spec = part.job.spec
        loaded = part.loaded
        attrs = dict(step)
        if part.moved and not held:
            loaded = spec.start
            attrs["ctxcache.kv.lease_race"] = True
            self.counters.add("load_races")
            log.warning(
                "request %s: the step's lease ended before its copies did; recomputing",
                spec.req_id,
            )
        elif part.moved:
            self.counters.add("load_bytes_shm", part.moved)
            attrs["ctxcache.kv.bytes_shm"] = part.moved
            attrs["ctxcache.kv.blocks_shm"] = part.blocks
        attrs["ctxcache.kv.loaded_tokens"] = loaded - spec.start
        if part.span is not None:
            part.span.set_attributes(attrs)
        self.counters.add("loaded_tokens", loaded - spec.start)
        if loaded >= spec.end:
            return set()
        self.counters.add("load_failures")
        return self._blocks_of(spec.block_ids, loaded, spec.end)

    def _load_paths(self, job: _Job, spec: LoadSpec, pieces: list[Piece]) -> int:
        if self.local is not None:
            try:
                done, rest = self._load_local(job, pieces)
            except LocalError as exc:
                self.counters.add("sidecar_errors")
                log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
            else:
                job.written = done
                if not rest:
                    return done
                # blocks the region could not hold: the rest over lm:// (rare)
                return self._load_tcp(job, replace(spec, start=done), rest)
        return self._load_tcp(job, spec, pieces)

    def _load_local(self, job: _Job, pieces: list[Piece]) -> tuple[int, list[Piece]]:
        """One round trip leases the blocks; copies from the region; a release that says the
        lease held makes them good, else everything written here is recomputed. Returns the
        first token not written and the pieces to get over TCP instead (from a block the
        sidecar holds but could not place in the region)."""
        assert self.local is not None and self.copier is not None
        t0 = time.perf_counter()
        lease = self.local.lease([self.key(p.key) for p in pieces])
        if lease.region is None:
            return job.spec.start, []
        region = self._use_region(lease.region)
        try:
            return self._copy_leased(job, pieces, lease, region, t0)
        finally:
            self._done_with_region(lease.region)

    def _copy_leased(
        self, job: _Job, pieces: list[Piece], lease: Lease, region: torch.Tensor, t0: float
    ) -> tuple[int, list[Piece]]:
        """The copies of a lease's blocks, whole before its release: a sync load waits on
        the host, the loader thread polls their handle; the release (trusted at once if the
        lease is valid beyond doubt, `LocalClient.release`) says the lease held through
        them. Should they raise, the lease goes back once none runs."""
        assert self.local is not None
        spec = job.spec
        try:
            done, moved, rest, blocks = self._copy_blocks(job, pieces, lease.blocks, region)
        except BaseException:
            self.local.release(lease, defer=False)  # what was written is recomputed
            raise
        if not self.local.release(lease):
            tracing.annotate({"ctxcache.kv.lease_race": True})
            self.counters.add("load_races")
            log.warning("request %s: the lease ended before the copy did; recomputing", spec.req_id)
            return spec.start, []
        self.counters.add("load_bytes_shm", moved)
        self.counters.add("load_us_shm", round((time.perf_counter() - t0) * 1e6))
        tracing.annotate({"ctxcache.kv.bytes_shm": moved, "ctxcache.kv.blocks_shm": blocks})
        return done, rest

    def _copy_blocks(
        self,
        job: _Job,
        pieces: list[Piece],
        blocks: Sequence[Slot | str | None],
        region: torch.Tensor,
    ) -> tuple[int, int, list[Piece], int]:
        """Write `pieces` from their leased `blocks`, the copies done when this returns.
        Returns the first token written past, the bytes read, the pieces to get over TCP
        (from a block the sidecar holds but could not place in the region) and how many
        blocks went in the engine's layout. Should a copy raise, it raises once none runs."""
        assert self.copier is not None
        spec = job.spec
        done, moved, rest = spec.start, 0, []
        batch: list[tuple[list[int], torch.Tensor, int, int]] = []  # engine-layout pieces
        try:
            for i, (piece, block) in enumerate(zip(pieces, blocks, strict=True)):
                lo, hi = max(done, piece.begin), min(spec.end, piece.end)
                if block == TCP:
                    rest = pieces[i:]
                    break
                if not isinstance(block, Slot):
                    break  # a miss: recomputed from here
                src = region[block.offset : block.offset + block.length]
                if not self._write_piece(job, piece, block, src, lo, hi, batch):
                    log.warning(
                        "request %s: block %s is not KV this engine reads; recomputing",
                        spec.req_id,
                        piece.key,
                    )
                    break
                done, moved = hi, moved + block.length
            self._settle(self._copy(self.copier.write_many, batch, job.after), job.background)
        except BaseException:
            self._quiesce(spec.req_id)  # no copy reads the leased slots any more
            raise
        return done, moved, rest, len(batch)

    @staticmethod
    def _copy(copy: Callable[..., CopyHandle], items: list[Any], after: Any) -> CopyHandle:
        """Issue the copier's `write_many`/`read_many` of `items`, touching the cache only
        after the compute stream's event `after`; their handle (`BlockCopier`)."""
        return copy(items, after=after)

    def _order_after(self, after: Any) -> None:
        """Make the calling thread's current stream wait for `after` (the loader thread's
        stream is not vLLM's: its own kernels, a TCP load's scatters, must wait too)."""
        if after is not None and self.copier is not None and self.copier.device.type == "cuda":
            torch.cuda.current_stream(self.copier.device).wait_event(after)

    @staticmethod
    def _settle(handle: CopyHandle, background: bool) -> None:
        """Wait for copies to be done: on the loader thread by polling their event (no host
        synchronize holds it), on vLLM's thread on the host (a sync load is the step's)."""
        if not background:
            handle.wait()
            return
        while not handle.done():
            time.sleep(_POLL_S)

    def _write_piece(
        self,
        job: _Job,
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
        spec, shape = job.spec, self.shape
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

    def _load_tcp(self, job: _Job, spec: LoadSpec, pieces: list[Piece]) -> int:
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
            done = job.written = hi
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
        """Copy the finished requests' blocks out (on vLLM's model-runner thread, after the
        forward pass: the copies wait for an event recorded here on its stream). Never
        raises: a store that fails is dropped, counted and logged."""
        if not plan.stores:
            return
        after = None
        if self.enabled:
            assert self.copier is not None
            try:
                after = compute_done(self.copier.device)
            except Exception:
                log.exception("cannot order this step's stores after its compute; dropped")
                self.counters.add("store_errors", len(plan.stores))
                self.counters.add("store_drops", len(plan.stores))
                self._sent.update(spec.req_id for spec in plan.stores)
                return
        for spec in plan.stores:
            t0 = time.perf_counter()
            tokens = {"ctxcache.kv.store_tokens": sum(p.length for p in spec.pieces)}
            try:
                with tracing.span_in(spec.trace, "ctxcache.kv.store", tokens):
                    saved = self.enabled and self._save(spec, after)
                    tracing.annotate({"ctxcache.kv.stored": saved})
                if not saved:
                    self.counters.add("store_drops")
            except Exception as exc:
                self.counters.add("store_drops")
                self.counters.add("store_errors")
                log.warning(
                    "request %s: storing its KV failed (%s: %s); dropped",
                    spec.req_id,
                    type(exc).__name__,
                    exc,
                    exc_info=not isinstance(exc, torch.OutOfMemoryError),
                )
            finally:
                self._sent.add(spec.req_id)  # the copy is made (or given up): free the blocks
                self.counters.add("store_copy_ms", round((time.perf_counter() - t0) * 1e3))

    def _save(self, spec: StoreSpec, after: Any = None) -> bool:
        if self.local is not None:
            try:
                if self._save_local(spec, after):
                    return True
            except LocalError as exc:
                self.counters.add("sidecar_errors")
                log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
        return self._save_tcp(spec)

    def _save_local(self, spec: StoreSpec, after: Any = None) -> bool:
        """Copy the blocks into slots the sidecar allocated, then commit them (two round
        trips). False when the region is full (the caller stores over TCP). Copies that
        raise end the lease with an abort, once none of them writes into its slots; if
        that cannot be known (a broken CUDA context) the slots stay the sidecar's until this
        process ends (docs/sidecar.md, invariant 2)."""
        assert self.local is not None and self.copier is not None
        t0 = time.perf_counter()
        lease = self.local.alloc([self.copier.nbytes(p.length) for p in spec.pieces])
        if lease is None:
            self.counters.add("region_full")
            return False
        region = self._use_region(lease.region)
        try:
            items = [
                (
                    self._kernel_blocks(spec.block_ids, piece.begin, piece.end),
                    region[slot.offset : slot.offset + slot.length],
                )
                for piece, slot in zip(spec.pieces, lease.slots, strict=True)
            ]
            self._copy(self.copier.read_many, items, after).wait()  # the commit needs them
        except BaseException:
            if self._quiesce(spec.req_id):
                self.local.abort(lease)  # nothing more is written: the slots can go back
            else:
                log.error(
                    "request %s: copies into the shared region may still run; its slots "
                    "stay the sidecar's until this process ends",
                    spec.req_id,
                )
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
        for pin in self._pinning:  # (a region let go meanwhile is unpinned by its thread)
            pin.join(_PIN_JOIN_S)
        self._pinning = []
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
