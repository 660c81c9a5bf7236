"""The connector's scheduler half: finds a request's prefix in the sidecar, plans loads and
stores, and hands them to the worker half in each step's metadata.

It runs in vLLM's engine-core process, on the scheduler's thread, so a lookup is one
pipelined round trip of EXISTs (every chunk key and every tail candidate) on one blocking
connection, and only for requests that carry a session tag (or every request with
`store_sessionless`). A sidecar that fails or times out opens a
circuit breaker: requests then run as if the sidecar were empty, and no stores are planned.
A worker that cannot carry out loads (`turn_off`, from its step output) makes it plan no
more loads or stores, for good: each would be a miss, recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ctxcache import tracing
from ctxcache.lmcache_keys import tags_from_params
from vllm_connector.config import ConnectorConfig
from vllm_connector.group_plan import GroupPlanner
from vllm_connector.plan import LoadSpec, Lookup, Planner, StoreSpec, session_of
from vllm_connector.state_plan import StatePlanner
from vllm_connector.stats import Counters
from worker.kv.hashing import salt_root
from worker.kv.sidecar import CircuitBreaker, ClientFactory

log = logging.getLogger(__name__)


class RequestLike(Protocol):
    """What we read of vLLM's `vllm.v1.request.Request`."""

    request_id: str
    kv_transfer_params: dict[str, Any] | None
    cache_salt: str | None
    all_token_ids: Sequence[int]
    num_computed_tokens: int
    trace_headers: Mapping[str, str] | None  # (vLLM's tracing on) the caller's traceparent

    @property
    def num_tokens(self) -> int: ...


@dataclass
class StepPlan:
    """The connector metadata of one engine step (pickled to the worker processes)."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)


@dataclass(frozen=True)
class _View:
    tags: tuple[tuple[str, str], ...]
    root: int
    session: str


class SchedulerSide:
    def __init__(
        self,
        config: ConnectorConfig,
        planner: Planner | GroupPlanner | StatePlanner,
        make_client: ClientFactory,
    ) -> None:
        self.config, self.planner = config, planner
        self.breaker = CircuitBreaker()
        self.counters = Counters()
        self._make_client = make_client
        self._client: Any = None
        self._lookups: dict[str, tuple[int, Lookup]] = {}
        self._found: dict[str, set[str]] = {}
        self._loads: dict[str, list[LoadSpec]] = {}  # one per KV cache group loaded
        self._stores: list[StoreSpec] = []
        self._loading: dict[str, set[int]] = {}  # (async_loads) request -> blocks loading
        self._failed: set[str] = set()  # requests whose async load failed: not loaded again
        self.off: str | None = None  # why the workers carry out no load (then none is planned)

    def turn_off(self, reason: str) -> None:
        """A worker reported that it carries out no load: plan none, nor any store, from
        now on (the loads already planned go out and come back as misses)."""
        if self.off is None:
            log.error("ctxcache connector: a worker is off (%s); no more loads or stores", reason)
        self.off = reason

    # -- the sidecar ----------------------------------------------------------------------
    def _exists_many(self, keys: list[str]) -> list[bool]:
        """One pipelined round trip; every key missing when the sidecar fails."""
        if not self.breaker.closed:
            return [False] * len(keys)
        try:
            if self._client is None:
                self._client = self._make_client()
            found = [bool(f) for f in self._client.exists_many(keys)]
        except Exception as exc:
            backoff = self.breaker.failure()
            self.counters.add("sidecar_errors")
            if self._client is not None:
                self._client.close()
                self._client = None
            log.warning("sidecar lookup failed (%s); skipping it for %.0f s", exc, backoff)
            return [False] * len(keys)
        self.breaker.success()
        return found

    # -- per request ----------------------------------------------------------------------
    def _view(self, request: RequestLike) -> _View | None:
        """The request's tags and hash root, or None when the connector leaves it alone."""
        try:
            tags = tags_from_params(request.kv_transfer_params)
        except ValueError as exc:
            log.warning("request %s: %s; not using the sidecar", request.request_id, exc)
            return None
        session = session_of(tags)
        if session is None and not self.config.store_sessionless:
            return None
        if not self.planner.usable(tags):
            log.warning("request %s: tags too long for LMCache's keys", request.request_id)
            return None
        return _View(tags, salt_root(request.cache_salt), session or "-")

    def matched_tokens(self, request: RequestLike, num_computed: int) -> int:
        """Tokens beyond `num_computed` that the sidecar will supply (0: none worth it)."""
        if self.off is not None:
            return 0
        view = self._view(request)
        if view is None or not self.breaker.closed or request.request_id in self._failed:
            return 0
        rid = request.request_id
        cached = self._lookups.get(rid)
        if cached is not None and cached[0] == num_computed:
            lookup = cached[1]
        else:
            t0 = time.perf_counter()
            n = request.num_tokens
            ids = list(request.all_token_ids[:n])
            attributes = {tracing.SESSION_ATTR: view.session, "ctxcache.kv.prompt_tokens": n}
            with tracing.span_in(_trace(request), "ctxcache.kv.lookup", attributes):
                lookup = self.planner.lookup(ids, n - 1, view.tags, view.root, self._exists_many)
                tracing.annotate(
                    {
                        "ctxcache.kv.found_tokens": lookup.tokens,
                        "ctxcache.kv.found_blocks": len(lookup.pieces),
                        "ctxcache.kv.computed_tokens": num_computed,
                    }
                )
            self._lookups[rid] = (num_computed, lookup)
            self._found[rid] = lookup.found
            self.counters.add("lookups")
            self.counters.add("lookup_us", round((time.perf_counter() - t0) * 1e6))
        extra = lookup.tokens - num_computed
        if extra < self.config.min_load_tokens:
            return 0
        return extra

    def after_alloc(self, request: RequestLike, block_ids: list[int], num_external: int) -> None:
        """`after_alloc_groups` for a model of one KV cache group."""
        self.after_alloc_groups(request, (block_ids,), num_external)

    def after_alloc_groups(
        self, request: RequestLike, blocks: Sequence[Sequence[int]], num_external: int
    ) -> None:
        """Plan the load vLLM just made room for, into the request's own blocks of each KV
        cache group (all of them, from its first token: vLLM's `get_blocks` at allocation;
        a sliding-window group's blocks before its window are vLLM's null block)."""
        cached = self._lookups.pop(request.request_id, None)
        if num_external <= 0 or cached is None:
            return
        specs = self.planner.load_specs(
            request.request_id, cached[1], num_external, blocks, _trace(request)
        )
        if not specs:  # (never expected) vLLM counts on a load: one that fails, recomputed
            end = cached[1].tokens
            specs = [LoadSpec(request.request_id, end - num_external, end, [], list(blocks[0]))]
        self._loads[request.request_id] = specs
        if self.config.async_loads:
            held = {b for spec in specs for b in spec.block_ids}
            self._loading[request.request_id] = held
        self.counters.add("load_tokens_planned", num_external)

    def loads_reported(
        self, done: Iterable[str], failed_blocks: set[int], failed: Iterable[str] = ()
    ) -> None:
        """(async_loads) The workers' report of a step: loads over, blocks that failed (and,
        for a hybrid model, requests whose load failed: vLLM's `failed_recving`). A
        request whose load failed recomputes what it lost; were it looked up again (vLLM
        asks again when nothing of the load was usable), the same broken blocks would be
        planned again, so it is not: it is computed, and its KV stored anew at its end."""
        failed = set(failed)
        for rid in done:
            blocks = self._loading.pop(rid, set())
            if blocks & failed_blocks or rid in failed:
                self._failed.add(rid)

    def build(self, scheduler_output: Any) -> StepPlan:
        """This step's plan: every load planned since the last step (vLLM schedules a
        request in the step it allocates it, and its blocks are known since then, so no
        planned load is left out: a load that cannot be carried out is reported as failed
        blocks by the worker, never skipped) and the stores of finished requests."""
        plan = StepPlan(loads=[spec for specs in self._loads.values() for spec in specs])
        self._loads.clear()
        plan.stores, self._stores = self._stores, []
        return plan

    def finished(self, request: RequestLike, block_ids: list[int]) -> bool:
        """`finished_groups` for a model of one KV cache group."""
        return self.finished_groups(request, (block_ids,))

    def finished_groups(self, request: RequestLike, blocks: Sequence[Sequence[int]]) -> bool:
        """Plan the finished request's stores, from its blocks of each KV cache group; True
        keeps its blocks until they are read."""
        rid = request.request_id
        found = self._found.pop(rid, set())
        self._lookups.pop(rid, None)
        self._loads.pop(rid, None)
        self._loading.pop(rid, None)
        self._failed.discard(rid)
        if self.off is not None:
            return False
        view = self._view(request)
        if view is None or not self.breaker.closed or _still_loading(request):
            return False
        in_flight = int(getattr(request, "num_in_flight_tokens", 0) or 0)
        if in_flight and isinstance(self.planner, StatePlanner):
            return False  # its state block already holds a later token's state: none to store
        valid = min(request.num_computed_tokens - in_flight, len(request.all_token_ids))
        if valid <= 0:
            return False
        ids = list(request.all_token_ids[:valid])
        specs = self.planner.store_specs(
            rid, view.session, ids, view.tags, view.root, found, blocks, _trace(request)
        )
        self._stores.extend(specs)
        return bool(specs)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _trace(request: RequestLike) -> dict[str, str] | None:
    """The request's trace headers, when vLLM traces it (`--otlp-traces-endpoint`) and the
    connector's tracing is on: its lookup, load and store spans join that trace."""
    headers = getattr(request, "trace_headers", None)
    if not headers or not tracing.enabled():
        return None
    return {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")} or None


def _still_loading(request: RequestLike) -> bool:
    """Whether the request ended (aborted) while its async load still writes its blocks:
    nothing of it is stored (vLLM frees its blocks once the load is reported)."""
    status = getattr(request, "status", None)
    return getattr(status, "name", "") == "WAITING_FOR_REMOTE_KVS"
