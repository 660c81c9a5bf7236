"""The shared-memory path's stores (`ShmStorer`): from vLLM's blocks into slots of the
local sidecar's region, then committed (docs/vllm.md, "KV paths").

A store copies the finished request's blocks out with one gather per layer, after an
event recorded on vLLM's compute stream (`ordering.compute_done`), into slots the sidecar
allocated, then commits them: at once when the copies are done, else in a later step
(`settle`: on a GPU the model-runner thread does not wait for them), the request's blocks
held until then. A full region, a commit the sidecar did not take or a local sidecar that
failed sends the store over `lm://` (`TcpPath.store`). A store that raises is dropped
(`store_errors`, `dropped`); it never fails vLLM's step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ctxcache import tracing
from sidecar.local_client import LocalClient, LocalError, WriteLease
from sidecar.protocol import FMT_ENGINE_BLOCKS
from vllm_connector.ordering import CopyHandle
from vllm_connector.paged import PagedKV
from vllm_connector.plan import StoreSpec
from vllm_connector.regions import Regions
from vllm_connector.stats import Counters
from vllm_connector.tcp_path import TcpPath

if TYPE_CHECKING:
    pass

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")


@dataclass
class Storing:
    """A store whose copies into the region's slots were issued: committed once they are
    done (`ShmStorer.settle`), its request's blocks held until then. On CPU the copies are
    done when issued, and it is committed at once."""

    spec: StoreSpec
    lease: WriteLease
    handle: CopyHandle
    t0: float


def dropped(counters: Counters, spec: StoreSpec, exc: Exception) -> None:
    """A store that raised: counted (`store_drops`, `store_errors`) and logged."""
    counters.add("store_drops")
    counters.add("store_errors")
    log.warning(
        "request %s: storing its KV failed (%s: %s); dropped",
        spec.req_id,
        type(exc).__name__,
        exc,
        exc_info=not isinstance(exc, torch.OutOfMemoryError),
    )


class ShmStorer:
    def __init__(
        self,
        kv: PagedKV,
        local: LocalClient,
        regions: Regions,
        tcp: TcpPath,
        counters: Counters,
    ) -> None:
        self.kv = kv
        self.local = local
        self.regions = regions
        self.tcp = tcp  # for what the region cannot take
        self.counters = counters
        self._storing: list[Storing] = []  # stores whose copies run (CUDA): `settle`

    def store(self, spec: StoreSpec, after: Any = None) -> bool | Storing:
        """Store `spec` through shared memory, else over TCP: True when done, a `Storing`
        whose copies still run (CUDA; held here until `settle` commits it), False when
        dropped."""
        if any(p.begin % self.kv.copier.tokens for p in spec.pieces):
            # (engine blocks start on a kernel block: a piece that does not — chunks
            # smaller than a hybrid model's block — goes as KV_2LTD over lm://)
            return self.tcp.store(spec)
        try:
            saved = self._save(spec, after)
            if isinstance(saved, Storing):  # its blocks are held until it is committed
                self._storing.append(saved)
            if saved:
                return saved
        except LocalError as exc:
            self.counters.add("sidecar_errors")
            log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
        return self.tcp.store(spec)

    def settle(self, *, wait: bool = False) -> set[str]:
        """Commit the stores whose copies into the shared region are done (every one, with
        `wait`: at close); their requests, whose blocks vLLM may free. On vLLM's
        model-runner thread (`take_sent`, each step), like `store`. Never raises."""
        still: list[Storing] = []
        over: set[str] = set()
        for pending in self._storing:
            spec = pending.spec
            try:
                if not wait and not pending.handle.done():
                    still.append(pending)
                    continue
                if not self._committed(pending):
                    self.counters.add("store_drops")
            except Exception as exc:
                dropped(self.counters, spec, exc)
            over.add(spec.req_id)
        self._storing = still
        return over

    def _save(self, spec: StoreSpec, after: Any = None) -> bool | Storing:
        """Copy the blocks into slots the sidecar allocated, then commit them (two round
        trips): at once when the copies are done, else once they are (`settle`: on a GPU
        the model-runner thread does not wait for them). False when the region is full (the
        caller stores over TCP). Copies that raise end the lease with an abort, once none of
        them writes into its slots; if that cannot be known (a broken CUDA context) the
        slots stay the sidecar's until this process ends (docs/sidecar.md, invariant 2)."""
        kv = self.kv
        t0 = time.perf_counter()
        lease = self.local.alloc([kv.copier.nbytes(p.length) for p in spec.pieces])
        if lease is None:
            self.counters.add("region_full")
            return False
        region = self.regions.use(lease.region)
        try:
            items = [
                (
                    kv.kernel_blocks(spec.block_ids, piece.begin, piece.end),
                    region[slot.offset : slot.offset + slot.length],
                )
                for piece, slot in zip(spec.pieces, lease.slots, strict=True)
            ]
            handle = kv.copier.read_many(items, after=after)
        except BaseException:
            self._give_up(spec, lease)
            raise
        pending = Storing(spec, lease, handle, t0)
        if handle.done():
            return self._committed(pending, fallback=False)
        return pending

    def _give_up(self, spec: StoreSpec, lease: WriteLease) -> None:
        """The lease's copies failed: abort it once nothing more is written into it."""
        try:
            if self.kv.quiesce(spec.req_id):
                self.local.abort(lease)  # nothing more is written: the slots can go back
            else:
                log.error(
                    "request %s: copies into the shared region may still run; its slots "
                    "stay the sidecar's until this process ends",
                    spec.req_id,
                )
                self.local.keep_until_exit(lease)  # a clean close must not free them
        finally:
            self.regions.done_with(lease.region)

    def _committed(self, pending: Storing, *, fallback: bool = True) -> bool:
        """Commit a store whose copies are done; with `fallback` (a later step's `settle`),
        a commit the sidecar did not take, or a sidecar that failed, goes over TCP (`store`
        does that for a store committed at once)."""
        kv, spec, lease = self.kv, pending.spec, pending.lease
        try:
            pending.handle.wait()  # done: returns at once (and lets go of what it kept)
        except BaseException:
            self._give_up(spec, lease)
            raise
        self.regions.done_with(lease.region)
        tag, elems, layers = kv.copier.tag, kv.copier.elems, len(kv.caches)
        try:
            stored = self.local.commit(
                lease,
                [
                    (
                        kv.key(p.key),
                        FMT_ENGINE_BLOCKS,
                        kv.shape.dtype_code,
                        (layers, p.length, elems, tag),
                    )
                    for p in spec.pieces
                ],
            )
        except LocalError as exc:
            if not fallback:
                raise
            self.counters.add("sidecar_errors")
            log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
            return self.tcp.store(spec)
        nbytes = sum(s.length for s in lease.slots)
        if stored < len(spec.pieces):  # not taken (the lease ended, the store refused)
            self.counters.add("store_failures_shm")
            log.warning(
                "request %s: the sidecar stored %d of %d blocks from shared memory; over TCP",
                spec.req_id,
                stored,
                len(spec.pieces),
            )
            return self.tcp.store(spec) if fallback else False
        self.counters.add("stored_blocks", stored)
        self.counters.add("stored_tokens", sum(p.length for p in spec.pieces))
        self.counters.add("store_bytes_shm", nbytes)
        self.counters.add("store_us_shm", round((time.perf_counter() - pending.t0) * 1e6))
        tracing.annotate({"ctxcache.kv.bytes_shm": nbytes})
        return True
