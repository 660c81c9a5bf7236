"""A load's two data paths (docs/vllm.md, "KV paths"), as functions of the connector's
worker half (`vllm_connector.worker.WorkerSide`, which plans, reports and counts loads):

- **shm**, when the sidecar runs on this node (`local_dir`): one round trip leases the
  blocks, the copies go straight from the sidecar's shared region into vLLM's blocks (the
  blocks are stored in vLLM's own block layout, so a load is a few large copies per layer,
  `vllm_connector.blockcopy`), and a release confirms that nothing raced them. A step's
  sync loads share one lease (`load_step`: one round trip, one release, each request's
  own span and counts); an async load takes its own (`load_local`).
- **tcp** (lm://, a remote sidecar, or whatever the shm path cannot serve): a load's
  blocks come in one pipelined round trip of GETs (LMCache's `KV_2LTD`); each piece is put
  into vLLM's block layout, every layer at once (a strided copy or two), then written as
  whole-block row copies as the shm path does (`BlockCopier.write_2ltd`; on CUDA, and for
  a piece that ends inside a block, one scatter per layer).

A block that is missing, unreadable or not the KV we store ends the load there: the
caller recomputes from the first token not written (`Job.written`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ctxcache import tracing
from sidecar.local_client import TCP, LocalError, ReadLease, Slot
from sidecar.protocol import FMT_ENGINE_BLOCKS, FMT_KV_2LTD
from vllm_connector.layout import token_slots
from vllm_connector.ordering import CopyHandle, settle
from vllm_connector.plan import LoadSpec, Piece

if TYPE_CHECKING:
    from vllm_connector.worker import WorkerSide

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")

_GET_GROUP = 2  # blocks per GET round trip of a TCP load (the next group arrives meanwhile)


@dataclass
class Job:
    """One load being carried out: the compute stream's event its copies wait on, whether it
    runs on the loader thread, the first token not (known to be) written, and (async) the
    handle of copies still in flight when it returns."""

    spec: LoadSpec
    after: Any = None
    background: bool = False
    written: int = 0
    handle: CopyHandle | None = None


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


def load_step(side: WorkerSide, jobs: list[Job]) -> set[int]:
    """Sync loads of one step through shared memory: one lease for all their blocks
    (one round trip), each request's copies, one release of it all — trusted at once
    when the lease is valid beyond doubt (`LocalClient.release`: no round trip; the
    release rides on the next request). A release that says the lease did not hold
    makes every load that read under it a miss. Each request keeps its own span
    (`ctxcache.kv.load`, open until the release; the shared lease's round trip is the
    first one's child and is annotated on each) and its own counts, as `WorkerSide._carry_out`
    keeps them. Returns the blocks to recompute; never raises."""
    assert side.local is not None
    parts = [_Part(job, side._pieces(job.spec)) for job in jobs]
    t0 = time.perf_counter()
    lease: ReadLease | None = None
    error: Exception | None = None
    region: torch.Tensor | None = None
    step: dict[str, Any] = {"ctxcache.kv.step_loads": len(parts)}
    with contextlib.ExitStack() as open_spans:
        for n, part in enumerate(parts):
            spec = part.job.spec
            side.counters.add("loads")
            planned = {"ctxcache.kv.planned_tokens": spec.end - spec.start}
            span = tracing.span_in(spec.trace, "ctxcache.kv.load", planned)
            part.span = open_spans.enter_context(span)
            part.shm_done = part.loaded = spec.start
            if n == 0:
                lease, error = step_lease(side, parts, step)
                if lease is not None and lease.region is not None:
                    region = side.regions.use(lease.region)
                    open_spans.callback(side.regions.done_with, lease.region)
            blocks: Sequence[Slot | str | None] = []
            if lease is not None:
                first = sum(len(p.pieces) for p in parts[:n])
                blocks = lease.blocks[first : first + len(part.pieces)]
            step_part(side, part, lease, region, blocks, error)
        held = True
        if lease is not None and lease.id:
            raised = any(p.raised for p in parts)  # then wait for the answer
            held = side.local.release(lease, defer=False) if raised else side.local.release(lease)
        failed: set[int] = set()
        for part in parts:
            failed |= step_over(side, part, held, step)
    moved = sum(p.moved for p in parts)
    if held and moved:
        side.counters.add("load_us_shm", round((time.perf_counter() - t0) * 1e6))
    return failed


def step_lease(
    side: WorkerSide, parts: list[_Part], step: dict[str, Any]
) -> tuple[ReadLease | None, Exception | None]:
    """The step's one lease (in the first request's span). No lease: the local sidecar
    failed (every load goes over TCP), or the error that every load fails with (a
    sidecar that answers nonsense, a key this worker cannot name: a miss each)."""
    assert side.local is not None
    t0 = time.perf_counter()
    ids = ", ".join(p.job.spec.req_id for p in parts)
    try:
        keys = [side.key(p.key) for part in parts for p in part.pieces]
        lease = side.local.lease(keys)
    except LocalError as exc:
        side.counters.add("sidecar_errors")
        log.warning("requests %s: local sidecar failed (%s); over TCP", ids, exc)
        return None, None
    except Exception as exc:
        return None, exc
    step["ctxcache.kv.step_lease_us"] = round((time.perf_counter() - t0) * 1e6)
    step["ctxcache.kv.step_lease_keys"] = len(keys)
    return lease, None


def step_part(
    side: WorkerSide,
    part: _Part,
    lease: ReadLease | None,
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
            part.loaded = load_tcp(side, job, spec, part.pieces)
            return
        if region is None:
            return
        done, part.moved, rest, part.blocks = copy_blocks(side, job, part.pieces, blocks, region)
        part.shm_done = part.loaded = job.written = done
        if rest:  # blocks the region could not hold: the rest over lm:// (rare)
            part.loaded = load_tcp(side, job, replace(spec, start=done), rest)
    except Exception as exc:
        part.raised = True
        side._fail(job, exc)
        part.loaded = job.written


def step_over(side: WorkerSide, part: _Part, held: bool, step: dict[str, Any]) -> set[int]:
    """A part's outcome once the step's lease is released: counted and annotated on
    its span; its blocks to recompute."""
    spec = part.job.spec
    loaded = part.loaded
    attrs = dict(step)
    if part.moved and not held:
        loaded = spec.start
        attrs["ctxcache.kv.lease_race"] = True
        side.counters.add("load_races")
        log.warning(
            "request %s: the step's lease ended before its copies did; recomputing",
            spec.req_id,
        )
    elif part.moved:
        side.counters.add("load_bytes_shm", part.moved)
        attrs["ctxcache.kv.bytes_shm"] = part.moved
        attrs["ctxcache.kv.blocks_shm"] = part.blocks
    attrs["ctxcache.kv.loaded_tokens"] = loaded - spec.start
    if part.span is not None:
        part.span.set_attributes(attrs)
    side.counters.add("loaded_tokens", loaded - spec.start)
    if loaded >= spec.end:
        return set()
    side.counters.add("load_failures")
    return side._blocks_of(spec.block_ids, loaded, spec.end)


def load_paths(side: WorkerSide, job: Job, spec: LoadSpec, pieces: list[Piece]) -> int:
    if side.local is not None:
        try:
            done, rest = load_local(side, job, pieces)
        except LocalError as exc:
            side.counters.add("sidecar_errors")
            log.warning("request %s: local sidecar failed (%s); over TCP", spec.req_id, exc)
        else:
            job.written = done
            if not rest:
                return done
            # blocks the region could not hold: the rest over lm:// (rare)
            return load_tcp(side, job, replace(spec, start=done), rest)
    return load_tcp(side, job, spec, pieces)


def load_local(side: WorkerSide, job: Job, pieces: list[Piece]) -> tuple[int, list[Piece]]:
    """One round trip leases the blocks; copies from the region; a release that says the
    lease held makes them good, else everything written here is recomputed. Returns the
    first token not written and the pieces to get over TCP instead (from a block the
    sidecar holds but could not place in the region)."""
    assert side.local is not None and side.copier is not None
    t0 = time.perf_counter()
    lease = side.local.lease([side.key(p.key) for p in pieces])
    if lease.region is None:
        return job.spec.start, []
    region = side.regions.use(lease.region)
    try:
        return copy_leased(side, job, pieces, lease, region, t0)
    finally:
        side.regions.done_with(lease.region)


def copy_leased(
    side: WorkerSide,
    job: Job,
    pieces: list[Piece],
    lease: ReadLease,
    region: torch.Tensor,
    t0: float,
) -> tuple[int, list[Piece]]:
    """The copies of a lease's blocks, whole before its release: a sync load waits on
    the host, the loader thread polls their handle; the release (trusted at once if the
    lease is valid beyond doubt, `LocalClient.release`) says the lease held through
    them. Should they raise, the lease goes back once none runs."""
    assert side.local is not None
    spec = job.spec
    try:
        done, moved, rest, blocks = copy_blocks(side, job, pieces, lease.blocks, region)
    except BaseException:
        side.local.release(lease, defer=False)  # what was written is recomputed
        raise
    if not side.local.release(lease):
        tracing.annotate({"ctxcache.kv.lease_race": True})
        side.counters.add("load_races")
        log.warning("request %s: the lease ended before the copy did; recomputing", spec.req_id)
        return spec.start, []
    side.counters.add("load_bytes_shm", moved)
    side.counters.add("load_us_shm", round((time.perf_counter() - t0) * 1e6))
    tracing.annotate({"ctxcache.kv.bytes_shm": moved, "ctxcache.kv.blocks_shm": blocks})
    return done, rest


def copy_blocks(
    side: WorkerSide,
    job: Job,
    pieces: list[Piece],
    blocks: Sequence[Slot | str | None],
    region: torch.Tensor,
) -> tuple[int, int, list[Piece], int]:
    """Write `pieces` from their leased `blocks`, the copies done when this returns.
    Returns the first token written past, the bytes read, the pieces to get over TCP
    (from a block the sidecar holds but could not place in the region) and how many
    blocks went in the engine's layout. Should a copy raise, it raises once none runs."""
    assert side.copier is not None
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
            if not write_piece(side, job, piece, block, src, lo, hi, batch):
                log.warning(
                    "request %s: block %s is not KV this engine reads; recomputing",
                    spec.req_id,
                    piece.key,
                )
                break
            done, moved = hi, moved + block.length
        settle(side.copier.write_many(batch, after=job.after), job.background)
    except BaseException:
        side._quiesce(spec.req_id)  # no copy reads the leased slots any more
        raise
    return done, moved, rest, len(batch)


def write_piece(
    side: WorkerSide,
    job: Job,
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
    assert side.copier is not None
    spec, shape = job.spec, side.shape
    if block.dtype != shape.dtype_code:
        return False
    if block.fmt == FMT_ENGINE_BLOCKS:
        want = (len(side.caches), piece.length, side.copier.elems, side.copier.tag)
        if tuple(block.shape) != want or block.length != side.copier.nbytes(piece.length):
            return False
        # one id per payload block; those past `hi` are never touched (nor maybe allocated)
        ids = side._kernel_blocks(spec.block_ids, piece.begin, hi)
        ids += [-1] * (math.ceil(piece.length / side.copier.tokens) - len(ids))
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
        write_2ltd(side, spec, piece, kv.permute(0, 1, 3, 2, 4), lo, hi)
        return True
    return False


def write_2ltd(
    side: WorkerSide, spec: LoadSpec, piece: Piece, kv: torch.Tensor, lo: int, hi: int
) -> None:
    """Tokens [lo, hi) of `piece` from its KV_2LTD payload `kv` (`[2, L, H, T, D]`):
    whole blocks as the engine lays them out, then row copies (`write_2ltd`); the
    indexed scatter where that does not apply (a piece that ends inside a block, CUDA)."""
    assert side.copier is not None
    n = side.copier.tokens
    if piece.begin % n == 0 and piece.length % n == 0:
        ids = side._kernel_blocks(spec.block_ids, piece.begin, hi)
        ids += [-1] * (piece.length // n - len(ids))  # past `hi`: never touched
        if side.copier.write_2ltd(ids, kv, lo - piece.begin, hi - piece.begin):
            return
    slots = token_slots(spec.block_ids, side.block_size, side.layouts[0].tokens, lo, hi)
    side.copier.scatter_2ltd(slots, kv[:, :, :, lo - piece.begin : hi - piece.begin])


def load_tcp(side: WorkerSide, job: Job, spec: LoadSpec, pieces: list[Piece]) -> int:
    """Its blocks come in one pipelined round trip; the writes stop at the first that is
    missing."""
    assert side.sidecar is not None
    t0 = time.perf_counter()
    sidecar = side.sidecar
    # the GETs of the next blocks arrive (one round trip per group, on the prefetch
    # thread) while this one is written: the socket and the scatter overlap
    groups = [pieces[i : i + _GET_GROUP] for i in range(0, len(pieces), _GET_GROUP)]
    if side._prefetch is None:
        side._prefetch = ThreadPoolExecutor(1, thread_name_prefix="ctxcache-get")
    fetches = [
        side._prefetch.submit(sidecar.get_many, [(side.key(p.key), p.length) for p in group])
        for group in groups
    ]
    done, moved = spec.start, 0
    for piece, kv in _arrivals(groups, fetches):
        lo, hi = max(done, piece.begin), min(spec.end, piece.end)
        if kv is None:
            for fetch in fetches:
                fetch.cancel()
            log.warning(
                "request %s: block %s gone or unreadable; recomputing", spec.req_id, piece.key
            )
            return done
        write_2ltd(side, spec, piece, kv, lo, hi)
        done = job.written = hi
        moved += kv.numel() * kv.element_size()
    side.counters.add("load_bytes_tcp", moved)
    side.counters.add("load_us_tcp", round((time.perf_counter() - t0) * 1e6))
    tracing.annotate({"ctxcache.kv.bytes_tcp": moved})
    return done


def _arrivals(
    groups: list[list[Piece]], fetches: list[Future[list[torch.Tensor | None]]]
) -> Iterator[tuple[Piece, torch.Tensor | None]]:
    for group, fetch in zip(groups, fetches, strict=True):
        yield from zip(group, fetch.result(), strict=True)
