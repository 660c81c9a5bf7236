"""Stores, as functions of the connector's worker half (`vllm_connector.worker.WorkerSide`).

Stores copy the finished requests' blocks out with one gather per layer (the request's
blocks are freed as soon as that copy is made), after an event recorded on vLLM's compute
stream (`ordering.compute_done`). Through shared memory (`save_local`) the blocks go
into slots the sidecar allocated, then are committed; otherwise (`save_tcp`) they are
PUT from a background thread (`worker.kv.sidecar.SidecarKV`, the built-in worker's storer,
with its circuit breaker). A store that raises is dropped (`store_errors`); it never fails
vLLM's step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ctxcache import tracing
from sidecar.local_client import LocalError, WriteLease
from sidecar.protocol import FMT_ENGINE_BLOCKS
from vllm_connector import ordering
from vllm_connector.layout import gather, token_slots
from vllm_connector.ordering import CopyHandle
from vllm_connector.plan import StoreSpec
from vllm_connector.scheduler import StepPlan
from worker.kv.sidecar import StoreJob

if TYPE_CHECKING:
    from vllm_connector.worker import WorkerSide

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")


def save(side: WorkerSide, plan: StepPlan) -> None:
    """Copy the finished requests' blocks out (on vLLM's model-runner thread, after the
    forward pass: the copies wait for an event recorded here on its stream). Never
    raises: a store that fails is dropped, counted and logged."""
    if not plan.stores:
        return
    after = None
    if side.enabled:
        assert side.copier is not None
        try:
            after = ordering.compute_done(side.copier.device)
        except Exception:
            log.exception("cannot order this step's stores after its compute; dropped")
            side.counters.add("store_errors", len(plan.stores))
            side.counters.add("store_drops", len(plan.stores))
            side._sent.update(spec.req_id for spec in plan.stores)
            return
    for spec in plan.stores:
        t0 = time.perf_counter()
        tokens = {"ctxcache.kv.store_tokens": sum(p.length for p in spec.pieces)}
        saved: bool | Storing = False
        try:
            with tracing.span_in(spec.trace, "ctxcache.kv.store", tokens):
                saved = side.enabled and store(side, spec, after)
                tracing.annotate({"ctxcache.kv.stored": saved is not False})
            if not saved:
                side.counters.add("store_drops")
        except Exception as exc:
            _dropped(side, spec, exc)
        finally:
            if isinstance(saved, Storing):  # its blocks are held until it is committed
                side.storing.append(saved)
            else:  # the copy is made (or given up): free the blocks
                side._sent.add(spec.req_id)
            side.counters.add("store_copy_ms", round((time.perf_counter() - t0) * 1e3))


def settle(side: WorkerSide, *, wait: bool = False) -> None:
    """Commit the stores whose copies into the shared region are done (every one, with
    `wait`: at close); their requests' blocks are then reported sent. On vLLM's
    model-runner thread (`take_sent`, each step), like `save`. Never raises."""
    still: list[Storing] = []
    for pending in side.storing:
        spec = pending.spec
        try:
            if not wait and not pending.handle.done():
                still.append(pending)
                continue
            if not _committed(side, pending):
                side.counters.add("store_drops")
        except Exception as exc:
            _dropped(side, spec, exc)
        side._sent.add(spec.req_id)
    side.storing = still


def _dropped(side: WorkerSide, spec: StoreSpec, exc: Exception) -> None:
    side.counters.add("store_drops")
    side.counters.add("store_errors")
    log.warning(
        "request %s: storing its KV failed (%s: %s); dropped",
        spec.req_id,
        type(exc).__name__,
        exc,
        exc_info=not isinstance(exc, torch.OutOfMemoryError),
    )


def store(side: WorkerSide, spec: StoreSpec, after: Any = None) -> bool | Storing:
    """Store `spec` through shared memory, else over TCP: True when done, a `Storing`
    whose copies still run (CUDA), False when dropped."""
    if side.local is not None:
        try:
            saved = save_local(side, spec, after)
            if saved:
                return saved
        except LocalError as exc:
            side.counters.add("sidecar_errors")
            log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
    return save_tcp(side, spec)


@dataclass
class Storing:
    """A store whose copies into the region's slots were issued: committed once they are
    done (`settle`), its request's blocks held until then. On CPU the copies are done
    when issued, and it is committed at once."""

    spec: StoreSpec
    lease: WriteLease
    handle: CopyHandle
    t0: float


def save_local(side: WorkerSide, spec: StoreSpec, after: Any = None) -> bool | Storing:
    """Copy the blocks into slots the sidecar allocated, then commit them (two round
    trips): at once when the copies are done, else once they are (`settle`: on a GPU the
    model-runner thread does not wait for them). False when the region is full (the
    caller stores over TCP). Copies that raise end the lease with an abort, once none of
    them writes into its slots; if that cannot be known (a broken CUDA context) the slots
    stay the sidecar's until this process ends (docs/sidecar.md, invariant 2)."""
    assert side.local is not None and side.copier is not None
    t0 = time.perf_counter()
    lease = side.local.alloc([side.copier.nbytes(p.length) for p in spec.pieces])
    if lease is None:
        side.counters.add("region_full")
        return False
    region = side.regions.use(lease.region)
    try:
        items = [
            (
                side._kernel_blocks(spec.block_ids, piece.begin, piece.end),
                region[slot.offset : slot.offset + slot.length],
            )
            for piece, slot in zip(spec.pieces, lease.slots, strict=True)
        ]
        handle = side.copier.read_many(items, after=after)
    except BaseException:
        _give_up(side, spec, lease)
        raise
    pending = Storing(spec, lease, handle, t0)
    if handle.done():
        return _committed(side, pending, fallback=False)
    return pending


def _give_up(side: WorkerSide, spec: StoreSpec, lease: WriteLease) -> None:
    """The lease's copies failed: abort it once nothing more is written into it."""
    assert side.local is not None
    try:
        if side._quiesce(spec.req_id):
            side.local.abort(lease)  # nothing more is written: the slots can go back
        else:
            log.error(
                "request %s: copies into the shared region may still run; its slots "
                "stay the sidecar's until this process ends",
                spec.req_id,
            )
    finally:
        side.regions.done_with(lease.region)


def _committed(side: WorkerSide, pending: Storing, *, fallback: bool = True) -> bool:
    """Commit a store whose copies are done; with `fallback` (a later step's `settle`),
    a commit the sidecar did not take, or a sidecar that failed, goes over TCP (`store`
    does that for a store committed at once)."""
    assert side.local is not None and side.copier is not None
    spec, lease = pending.spec, pending.lease
    try:
        pending.handle.wait()  # done: returns at once (and lets go of what it kept)
    except BaseException:
        _give_up(side, spec, lease)
        raise
    side.regions.done_with(lease.region)
    tag, elems, layers = side.copier.tag, side.copier.elems, len(side.caches)
    try:
        stored = side.local.commit(
            lease,
            [
                (
                    side.key(p.key),
                    FMT_ENGINE_BLOCKS,
                    side.shape.dtype_code,
                    (layers, p.length, elems, tag),
                )
                for p in spec.pieces
            ],
        )
    except LocalError as exc:
        if not fallback:
            raise
        side.counters.add("sidecar_errors")
        log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
        return save_tcp(side, spec)
    nbytes = sum(s.length for s in lease.slots)
    if stored < len(spec.pieces):  # not taken (the lease ended, the store refused)
        side.counters.add("store_failures_shm")
        log.warning(
            "request %s: the sidecar stored %d of %d blocks from shared memory; over TCP",
            spec.req_id,
            stored,
            len(spec.pieces),
        )
        return save_tcp(side, spec) if fallback else False
    side.counters.add("stored_blocks", stored)
    side.counters.add("stored_tokens", sum(p.length for p in spec.pieces))
    side.counters.add("store_bytes_shm", nbytes)
    side.counters.add("store_us_shm", round((time.perf_counter() - pending.t0) * 1e6))
    tracing.annotate({"ctxcache.kv.bytes_shm": nbytes})
    return True


def save_tcp(side: WorkerSide, spec: StoreSpec) -> bool:
    assert side.sidecar is not None
    t0 = time.perf_counter()
    lo = min(p.begin for p in spec.pieces)
    hi = max(p.end for p in spec.pieces)
    slots = token_slots(spec.block_ids, side.block_size, side.layouts[0].tokens, lo, hi)
    kv = gather(side.caches, side.layouts, slots).cpu()
    blocks = [(side.key(p.key), kv[:, :, :, p.begin - lo : p.end - lo]) for p in spec.pieces]
    if not side.sidecar.submit(StoreJob(blocks, spec.session)):
        return False
    side.counters.add("stored_blocks", len(blocks))
    side.counters.add("stored_tokens", sum(p.length for p in spec.pieces))
    side.counters.add("store_bytes_tcp", kv.numel() * kv.element_size())
    side.counters.add("store_us_tcp", round((time.perf_counter() - t0) * 1e6))
    tracing.annotate({"ctxcache.kv.bytes_tcp": kv.numel() * kv.element_size()})
    return True
