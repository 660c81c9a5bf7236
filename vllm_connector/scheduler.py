"""The connector's scheduler half: finds a request's prefix in the sidecar, plans loads and
stores, and hands them to the worker half in each step's metadata.

It runs in vLLM's engine-core process, on the scheduler's thread, so a lookup is a few
EXIST round trips on one blocking connection, and only for requests that carry a session
tag (or every request with `store_sessionless`). A sidecar that fails or times out opens a
circuit breaker: requests then run as if the sidecar were empty, and no stores are planned.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ctxcache.lmcache_keys import tags_from_params
from vllm_connector.config import ConnectorConfig
from vllm_connector.plan import LoadSpec, Lookup, Planner, StoreSpec, session_of
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
        self, config: ConnectorConfig, planner: Planner, make_client: ClientFactory
    ) -> None:
        self.config, self.planner = config, planner
        self.breaker = CircuitBreaker()
        self.counters = Counters()
        self._make_client = make_client
        self._client: Any = None
        self._lookups: dict[str, tuple[int, Lookup]] = {}
        self._found: dict[str, set[str]] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._stores: list[StoreSpec] = []

    # -- the sidecar ----------------------------------------------------------------------
    def _exists(self, key: str) -> bool:
        if not self.breaker.closed:
            return False
        try:
            if self._client is None:
                self._client = self._make_client()
            found = bool(self._client.exists(key))
        except Exception as exc:
            backoff = self.breaker.failure()
            self.counters.add("sidecar_errors")
            if self._client is not None:
                self._client.close()
                self._client = None
            log.warning("sidecar lookup failed (%s); skipping it for %.0f s", exc, backoff)
            return False
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
        view = self._view(request)
        if view is None or not self.breaker.closed:
            return 0
        rid = request.request_id
        cached = self._lookups.get(rid)
        if cached is not None and cached[0] == num_computed:
            lookup = cached[1]
        else:
            n = request.num_tokens
            ids = list(request.all_token_ids[:n])
            lookup = self.planner.lookup(ids, n - 1, view.tags, view.root, self._exists)
            self._lookups[rid] = (num_computed, lookup)
            self._found[rid] = lookup.found
            self.counters.add("lookups")
        extra = lookup.tokens - num_computed
        if extra < self.config.min_load_tokens:
            return 0
        return extra

    def after_alloc(self, request: RequestLike, num_external: int) -> None:
        cached = self._lookups.pop(request.request_id, None)
        if num_external <= 0 or cached is None:
            return
        lookup = cached[1]
        start = lookup.tokens - num_external
        pieces = [p for p in lookup.pieces if p.end > start]
        self._loads[request.request_id] = LoadSpec(request.request_id, start, lookup.tokens, pieces)
        self.counters.add("load_tokens_planned", num_external)

    def build(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan()
        for new in scheduler_output.scheduled_new_reqs:
            spec = self._loads.pop(new.req_id, None)
            if spec is not None:
                spec.block_ids = list(new.block_ids[0])
                plan.loads.append(spec)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            spec = self._loads.pop(rid, None)
            if spec is not None and cached.new_block_ids[i] is not None:
                spec.block_ids = list(cached.new_block_ids[i][0])  # a resumed request's all
                plan.loads.append(spec)
        for rid in list(self._loads):
            log.warning("request %s: a planned load was not scheduled; dropped", rid)
            del self._loads[rid]
        plan.stores, self._stores = self._stores, []
        return plan

    def finished(self, request: RequestLike, block_ids: list[int]) -> bool:
        """Plan the finished request's stores; True keeps its blocks until they are read."""
        rid = request.request_id
        found = self._found.pop(rid, set())
        self._lookups.pop(rid, None)
        self._loads.pop(rid, None)
        view = self._view(request)
        if view is None or not self.breaker.closed:
            return False
        in_flight = int(getattr(request, "num_in_flight_tokens", 0) or 0)
        valid = min(request.num_computed_tokens - in_flight, len(request.all_token_ids))
        if valid <= 0:
            return False
        ids = list(request.all_token_ids[:valid])
        pieces = self.planner.stores(ids, valid, view.tags, view.root, found)
        if not pieces:
            return False
        self._stores.append(StoreSpec(rid, view.session, pieces, list(block_ids)))
        return True

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
