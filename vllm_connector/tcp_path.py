"""The `lm://` path (`TcpPath`): a remote sidecar, or whatever the shared-memory path
cannot serve (docs/vllm.md, "KV paths").

A load's blocks come in one pipelined round trip of GETs (LMCache's `KV_2LTD`; the next
group's GETs, on the prefetch thread, arrive while one is written); each piece is put into
vLLM's block layout, every layer at once, then written as whole-block row copies as the
shm path does (`PagedKV.write_2ltd`; on CUDA, and for a piece that ends inside a block,
one scatter per layer). A store gathers the request's tokens once and PUTs them from a
background thread (`worker.kv.sidecar.SidecarKV`, the built-in worker's storer, with its
circuit breaker).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ctxcache import tracing
from vllm_connector.layout import gather, token_slots
from vllm_connector.loads import Job, LoadRunner
from vllm_connector.paged import PagedKV
from vllm_connector.plan import LoadSpec, Piece, StoreSpec
from vllm_connector.stats import Counters
from worker.kv.sidecar import SidecarKV, StoreJob

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")

_GET_GROUP = 2  # blocks per GET round trip of a TCP load (the next group arrives meanwhile)


class TcpPath:
    def __init__(
        self, kv: PagedKV, sidecar: SidecarKV, runner: LoadRunner, counters: Counters
    ) -> None:
        self.kv = kv
        self.sidecar = sidecar
        self.runner = runner
        self.counters = counters
        self._prefetch: ThreadPoolExecutor | None = None  # the GETs, started on first use

    def load(self, jobs: list[Job]) -> set[int]:
        failed: set[int] = set()
        for job in jobs:
            failed |= self.runner.carry_out(job, self.load_pieces)
        return failed

    def load_pieces(self, job: Job, spec: LoadSpec, pieces: list[Piece]) -> int:
        """Write `pieces` from `spec.start`: their blocks come in one pipelined round
        trip, and the writes stop at the first that is missing. Returns the first token
        not written (`job.written` follows it)."""
        t0 = time.perf_counter()
        sidecar = self.sidecar
        # the GETs of the next blocks arrive (one round trip per group, on the prefetch
        # thread) while this one is written: the socket and the scatter overlap
        groups = [pieces[i : i + _GET_GROUP] for i in range(0, len(pieces), _GET_GROUP)]
        if self._prefetch is None:
            self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="ctxcache-get")
        fetches = [
            self._prefetch.submit(sidecar.get_many, [(self.kv.key(p.key), p.length) for p in group])
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
            self.kv.write_2ltd(spec, piece, kv, lo, hi)
            done = job.written = hi
            moved += kv.numel() * kv.element_size()
        self.counters.add("load_bytes_tcp", moved)
        self.counters.add("load_us_tcp", round((time.perf_counter() - t0) * 1e6))
        tracing.annotate({"ctxcache.kv.bytes_tcp": moved})
        return done

    def store(self, spec: StoreSpec, after: Any = None) -> bool:
        """Gather the request's tokens (on the stream vLLM computes on: after its forward
        pass) and queue their PUT; False when the storer is full or off (dropped)."""
        t0 = time.perf_counter()
        kv = self.kv
        lo = min(p.begin for p in spec.pieces)
        hi = max(p.end for p in spec.pieces)
        slots = token_slots(spec.block_ids, kv.block_size, kv.layouts[0].tokens, lo, hi)
        tokens = gather(kv.caches, kv.layouts, slots).cpu()
        blocks = [(kv.key(p.key), tokens[:, :, :, p.begin - lo : p.end - lo]) for p in spec.pieces]
        if not self.sidecar.submit(StoreJob(blocks, spec.session)):
            return False
        nbytes = tokens.numel() * tokens.element_size()
        self.counters.add("stored_blocks", len(blocks))
        self.counters.add("stored_tokens", sum(p.length for p in spec.pieces))
        self.counters.add("store_bytes_tcp", nbytes)
        self.counters.add("store_us_tcp", round((time.perf_counter() - t0) * 1e6))
        tracing.annotate({"ctxcache.kv.bytes_tcp": nbytes})
        return True

    def settle(self, *, wait: bool = False) -> set[str]:
        return set()  # a store is over once queued

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True)
            self._prefetch = None
        self.sidecar.close()


def _arrivals(
    groups: list[list[Piece]], fetches: list[Future[list[torch.Tensor | None]]]
) -> Iterator[tuple[Piece, torch.Tensor | None]]:
    for group, fetch in zip(groups, fetches, strict=True):
        yield from zip(group, fetch.result(), strict=True)
