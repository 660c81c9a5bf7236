"""The shared-memory path's loads (`ShmLoader`): from the local sidecar's region into
vLLM's blocks (docs/vllm.md, "KV paths").

One round trip leases the blocks, the copies go straight from the sidecar's shared region
into vLLM's blocks (the blocks are stored in vLLM's own block layout, so a load is a few
large copies per layer, `vllm_connector.blockcopy`), and a release confirms that nothing
raced them. A step's sync loads share one lease (`load_step`: one round trip, one
release, each request's own span and counts); an async load takes its own (`load_own`).
A block the region could not hold, or a local sidecar that failed, sends the rest of a
load over `lm://` (`TcpPath.load_pieces`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ctxcache import tracing
from sidecar.local_client import TCP, LocalClient, LocalError, Slot
from sidecar.protocol import FMT_ENGINE_BLOCKS
from vllm_connector.loads import Job, LoadRunner, pieces_in
from vllm_connector.ordering import settle
from vllm_connector.paged import PagedKV
from vllm_connector.plan import LoadSpec, Piece
from vllm_connector.regions import Regions
from vllm_connector.stats import Counters
from vllm_connector.tcp_path import TcpPath

if TYPE_CHECKING:
    from sidecar.local_client import ReadLease

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")

_STEP_KEYS = 4096  # keys in one shared lease at most (the sidecar's `MAX_KEYS`)


@dataclass
class _Part:
    """One request's part of a step's shared lease (`load_step`): its span,
    open until the shared release; what its copies from the region wrote (vouched for
    only by that release) and everything it wrote (a TCP rest too); what it read."""

    job: Job
    pieces: list[Piece]
    span: Any = None
    shm_done: int = 0
    loaded: int = 0
    moved: int = 0
    blocks: int = 0
    raised: bool = False


def _groups(jobs: list[Job]) -> Iterator[list[Job]]:
    """A step's sync loads in groups of at most `_STEP_KEYS` keys: one lease each."""
    group: list[Job] = []
    keys = 0
    for job in jobs:
        n = len(pieces_in(job.spec))
        if group and keys + n > _STEP_KEYS:
            yield group
            group, keys = [], 0
        group.append(job)
        keys += n
    if group:
        yield group


class ShmLoader:
    def __init__(
        self,
        kv: PagedKV,
        local: LocalClient,
        regions: Regions,
        tcp: TcpPath,
        runner: LoadRunner,
        counters: Counters,
    ) -> None:
        self.kv = kv
        self.local = local
        self.regions = regions
        self.tcp = tcp  # for what the region cannot serve
        self.runner = runner
        self.counters = counters

    def load(self, jobs: list[Job]) -> set[int]:
        """Async loads one by one, each under a lease of its own; sync loads (a step's)
        under one lease for at most `_STEP_KEYS` keys."""
        failed: set[int] = set()
        for job in jobs:
            if job.background:
                failed |= self.runner.carry_out(job, self.load_own)
        for group in _groups([job for job in jobs if not job.background]):
            failed |= self.load_step(group)
        return failed

    # -- a step's sync loads: one lease ------------------------------------------------------
    def load_step(self, jobs: list[Job]) -> set[int]:
        """Sync loads of one step through shared memory: one lease for all their blocks
        (one round trip), each request's copies, one release of it all — trusted at once
        when the lease is valid beyond doubt (`LocalClient.release`: no round trip; the
        release rides on the next request). A release that says the lease did not hold
        makes every load that read under it a miss. Each request keeps its own span
        (`ctxcache.kv.load`, open until the release; the shared lease's round trip is the
        first one's child and is annotated on each) and its own counts, as
        `LoadRunner.carry_out` keeps them. Returns the blocks to recompute; never raises."""
        parts = [_Part(job, pieces_in(job.spec)) for job in jobs]
        t0 = time.perf_counter()
        lease: ReadLease | None = None
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
                        region = self.regions.use(lease.region)
                        open_spans.callback(self.regions.done_with, lease.region)
                blocks: Sequence[Slot | str | None] = []
                if lease is not None:
                    first = sum(len(p.pieces) for p in parts[:n])
                    blocks = lease.blocks[first : first + len(part.pieces)]
                self._step_part(part, lease, region, blocks, error)
            held = True
            if lease is not None and lease.id:
                raised = any(p.raised for p in parts)  # then wait for the answer
                local = self.local
                held = local.release(lease, defer=False) if raised else local.release(lease)
            failed: set[int] = set()
            for part in parts:
                failed |= self._step_over(part, held, step)
        moved = sum(p.moved for p in parts)
        if held and moved:
            self.counters.add("load_us_shm", round((time.perf_counter() - t0) * 1e6))
        return failed

    def _step_lease(
        self, parts: list[_Part], step: dict[str, Any]
    ) -> tuple[ReadLease | None, Exception | None]:
        """The step's one lease (in the first request's span). No lease: the local sidecar
        failed (every load goes over TCP), or the error that every load fails with (a
        sidecar that answers nonsense, a key this worker cannot name: a miss each)."""
        t0 = time.perf_counter()
        ids = ", ".join(p.job.spec.req_id for p in parts)
        try:
            keys = [self.kv.key(p.key) for part in parts for p in part.pieces]
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
        lease: ReadLease | None,
        region: torch.Tensor | None,
        blocks: Sequence[Slot | str | None],
        error: Exception | None = None,
    ) -> None:
        """One request's copies under the step's lease (its TCP rest after them); a
        failure (`error`: the lease's) is logged and counted (`LoadRunner.fail`) and
        leaves what the part wrote."""
        job, spec = part.job, part.job.spec
        try:
            if error is not None:
                raise error
            if lease is None:
                part.loaded = self.tcp.load_pieces(job, spec, part.pieces)
                return
            if region is None:
                return
            done, part.moved, rest, part.blocks = self._copy(job, part.pieces, blocks, region)
            part.shm_done = part.loaded = job.written = done
            if rest:  # blocks the region could not hold: the rest over lm:// (rare)
                part.loaded = self.tcp.load_pieces(job, replace(spec, start=done), rest)
        except Exception as exc:
            part.raised = True
            self.runner.fail(job, exc)
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
        return self.runner.ended(spec, loaded)

    # -- an async load: a lease of its own ---------------------------------------------------
    def load_own(self, job: Job, spec: LoadSpec, pieces: list[Piece]) -> int:
        """`job`'s pieces under a lease of their own, the rest (or all of them, should the
        local sidecar fail) over TCP; the first token not written."""
        try:
            done, rest = self._load_leased(job, pieces)
        except LocalError as exc:
            self.counters.add("sidecar_errors")
            log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
            return self.tcp.load_pieces(job, spec, pieces)
        job.written = done
        if not rest:
            return done
        # blocks the region could not hold: the rest over lm:// (rare)
        return self.tcp.load_pieces(job, replace(spec, start=done), rest)

    def _load_leased(self, job: Job, pieces: list[Piece]) -> tuple[int, list[Piece]]:
        """One round trip leases the blocks; copies from the region; a release that says the
        lease held makes them good, else everything written here is recomputed. Returns the
        first token not written and the pieces to get over TCP instead (from a block the
        sidecar holds but could not place in the region)."""
        t0 = time.perf_counter()
        lease = self.local.lease([self.kv.key(p.key) for p in pieces])
        if lease.region is None:
            return job.spec.start, []
        region = self.regions.use(lease.region)
        try:
            return self._copy_leased(job, pieces, lease, region, t0)
        finally:
            self.regions.done_with(lease.region)

    def _copy_leased(
        self, job: Job, pieces: list[Piece], lease: ReadLease, region: torch.Tensor, t0: float
    ) -> tuple[int, list[Piece]]:
        """The copies of a lease's blocks, whole before its release: a sync load waits on
        the host, the loader thread polls their handle; the release (trusted at once if the
        lease is valid beyond doubt, `LocalClient.release`) says the lease held through
        them. Should they raise, the lease goes back once none runs."""
        spec = job.spec
        try:
            done, moved, rest, blocks = self._copy(job, pieces, lease.blocks, region)
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

    # -- the copies ----------------------------------------------------------------------------
    def _copy(
        self,
        job: Job,
        pieces: list[Piece],
        blocks: Sequence[Slot | str | None],
        region: torch.Tensor,
    ) -> tuple[int, int, list[Piece], int]:
        """Write `pieces` from their leased `blocks`, the copies done when this returns.
        Returns the first token written past, the bytes read, the pieces to get over TCP
        (from a block the sidecar holds but could not place in the region) and how many
        blocks went in the engine's layout. Should a copy raise, it raises once none runs."""
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
                if not self._write_piece(spec, piece, block, src, lo, hi, batch):
                    log.warning(
                        "request %s: block %s is not KV this engine reads; recomputing",
                        spec.req_id,
                        piece.key,
                    )
                    break
                done, moved = hi, moved + block.length
            settle(self.kv.copier.write_many(batch, after=job.after), job.background)
        except BaseException:
            self.kv.quiesce(spec.req_id)  # no copy reads the leased slots any more
            raise
        return done, moved, rest, len(batch)

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
        kv, copier = self.kv, self.kv.copier
        shape = kv.shape
        if block.dtype != shape.dtype_code:
            return False
        if block.fmt == FMT_ENGINE_BLOCKS:
            want = (len(kv.caches), piece.length, copier.elems, copier.tag)
            if tuple(block.shape) != want or block.length != copier.nbytes(piece.length):
                return False
            # one id per payload block; those past `hi` are never touched (nor maybe allocated)
            ids = kv.kernel_blocks(spec.block_ids, piece.begin, hi)
            ids += [-1] * (math.ceil(piece.length / copier.tokens) - len(ids))
            batch.append((ids, src, lo - piece.begin, hi - piece.begin))
            return True
        if block.fmt == shape.fmt:  # KV_2LTD (KV_MLA_FMT: an MLA model's one plane)
            if tuple(block.shape) != shape.wire_shape(piece.length):
                return False
            if block.length != piece.length * shape.bytes_per_token():
                return False
            payload = src.view(shape.dtype).view(
                shape.planes, shape.num_layers, piece.length, shape.num_kv_heads, shape.head_dim
            )
            kv.write_2ltd(spec, piece, payload.permute(0, 1, 3, 2, 4), lo, hi)
            return True
        return False
