"""What a load is (`Job`) and how each one ends (`LoadRunner`), for both KV paths
(`vllm_connector.shm_path`, `tcp_path`) and the worker half that hands loads to them.

A block that is missing, unreadable or not the KV we store ends the load there: the
blocks from the first token not written (`Job.written`) are recomputed. Anything a load
raises is caught per request (`LoadRunner.fail`): logged with its id, counted
(`load_errors`), a miss from the first token not written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ctxcache import tracing
from vllm_connector import ordering
from vllm_connector.ordering import CopyHandle
from vllm_connector.paged import PagedKV, blocks_of
from vllm_connector.plan import LoadSpec, Piece
from vllm_connector.stats import Counters

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")


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


# writes a job's pieces (of its spec, from spec.start); returns the first token not written
Write = Callable[[Job, LoadSpec, list[Piece]], int]


def pieces_in(spec: LoadSpec) -> list[Piece]:
    """The pieces with tokens of [start, end) in them."""
    return [p for p in spec.pieces if min(spec.end, p.end) > max(spec.start, p.begin)]


class LoadRunner:
    """Carries out one load at a time and accounts for it: its span (`ctxcache.kv.load`,
    in the request's trace: tokens planned and loaded), its counts, its failure as a miss.
    `kv` is None on a worker that never registered its cache (every load a miss)."""

    def __init__(self, counters: Counters, block_size: int, kv: PagedKV | None = None) -> None:
        self.counters = counters
        self.block_size = block_size
        self.kv = kv

    def carry_out(self, job: Job, write: Write | None) -> set[int]:
        """Load `job`'s spec with `write` (None: nothing can load, a miss); the blocks it
        could not write (to be recomputed). Anything it raises is a miss from the first
        token not written (`fail`)."""
        spec = job.spec
        self.counters.add("loads")
        planned = {"ctxcache.kv.planned_tokens": spec.end - spec.start}
        with tracing.span_in(spec.trace, "ctxcache.kv.load", planned):
            if write is None:
                loaded = spec.start
            else:
                try:
                    loaded = self._write(job, write)
                except Exception as exc:
                    self.fail(job, exc)
                    loaded = job.written
            tracing.annotate({"ctxcache.kv.loaded_tokens": loaded - spec.start})
        return self.ended(spec, loaded)

    def _write(self, job: Job, write: Write) -> int:
        """Write `job`'s tokens; returns the first token not written (`job.written` follows
        it, for `fail`)."""
        spec = job.spec
        pieces = pieces_in(spec)
        if not job.background or self.kv is None:
            return write(job, spec, pieces)
        # the loader thread's stream is not vLLM's: its kernels (a KV_2LTD piece's
        # scatter) wait for the step's event, and the load is over when they are
        device = self.kv.copier.device
        ordering.order_after(device, job.after)
        done = write(job, spec, pieces)
        if device.type == "cuda":
            job.handle = ordering.EventDone(ordering.record_event(device))
        return done

    def ended(self, spec: LoadSpec, loaded: int) -> set[int]:
        """A load over at token `loaded`: counted; the blocks to recompute."""
        self.counters.add("loaded_tokens", loaded - spec.start)
        if loaded >= spec.end:
            return set()
        self.counters.add("load_failures")
        return self.blocks(spec, loaded)

    def fail(self, job: Job, exc: BaseException) -> set[int]:
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
        self.quiesce(spec.req_id)
        job.handle = None
        return self.blocks(spec, job.written)

    def never_ran(self, job: Job, exc: BaseException) -> set[int]:
        """A load that could not start (`exc`): counted as one that failed."""
        self.counters.add("loads")
        self.counters.add("load_failures")
        return self.fail(job, exc)

    def quiesce(self, req_id: str) -> bool:
        """Wait until no copy issued so far runs (`PagedKV.quiesce`)."""
        return True if self.kv is None else self.kv.quiesce(req_id)

    def blocks(self, spec: LoadSpec, start: int | None = None) -> set[int]:
        """The blocks of `spec` from token `start` (its own start by default) to its end."""
        begin = spec.start if start is None else start
        return blocks_of(spec.block_ids, self.block_size, begin, spec.end)
