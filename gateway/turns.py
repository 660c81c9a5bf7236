"""Session turns: load + lock, build the prompt, run it on a worker, append with CAS.

A turn either commits whole (new input + generated ids + messages appended in one
compare-and-set, TTL slid, affinity recorded) or leaves the session exactly as it was:
any failure — worker error, timeout, client gone mid-stream — releases the lock and
appends nothing.

`TurnService` is what the endpoints' services call. It commits and releases here, and
hands the rest to its parts: `gateway.turn_planning` (load, lock, tokenize: the `Turn`),
`gateway.turn_engine` (the engine request, failover), `gateway.turn_stream` (a streamed
answer relayed); `gateway.turn_types` holds the `Turn` and `Generation` themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from cache_manager.client import ManagerClient
from cache_manager.protocol import (
    AppendTurn,
    Idempotency,
    SessionInfo,
    SessionState,
    StoredResponse,
)
from ctxcache import tracing
from ctxcache.errors import QuotaExceeded
from ctxcache.logs import bind_session
from ctxcache.tasks import BackgroundTasks
from gateway.locks import LockKeeper
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.prompts import PromptBuilder
from gateway.recent import RecentHistories
from gateway.salt import CacheSalt
from gateway.shaping import Shaper, cached_tokens
from gateway.turn_engine import TurnEngine
from gateway.turn_planning import TurnPlanner
from gateway.turn_stream import relay
from gateway.turn_types import Generation, Turn, span_attributes
from gateway.upstream import SSEStream

log = logging.getLogger(__name__)


class TurnService:
    def __init__(
        self,
        manager: ManagerClient,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        prompts: PromptBuilder,
        salt: CacheSalt | None = None,
        recent: RecentHistories | None = None,
        keeper: LockKeeper | None = None,
    ) -> None:
        self.manager = manager
        self.keeper = keeper if keeper is not None else LockKeeper(manager, max_hold_s=300.0)
        self.salt = salt or CacheSalt()
        self.pool = pool
        self.metrics = metrics
        self.prompts = prompts
        self.recent = recent if recent is not None else RecentHistories()
        self.background = BackgroundTasks(log)
        self.engine = TurnEngine(pool, metrics, self.salt)
        self.planner = TurnPlanner(
            manager, pool, metrics, prompts, self.recent, self.keeper, self.engine, self.release_now
        )

    # -- planning (gateway.turn_planning) ----------------------------------------------
    async def begin(
        self,
        tenant: str,
        session_id: str,
        kind: str,
        body: dict[str, Any],
        idempotency: Idempotency | None = None,
    ) -> Turn:
        """Load (and lock) the session; plan the turn (`TurnPlanner.begin`)."""
        return await self.planner.begin(tenant, session_id, kind, body, idempotency)

    async def check_quota(self, tenant: str, prompt_tokens: int) -> None:
        """Refuse a create the tenant's quota has no room for, before any inference. The
        session's write checks again, atomically and with the answer's tokens counted; this
        read only spares the client an answer (or a stream) that could not be kept."""
        usage = await self.manager.usage(tenant)
        if usage.sessions >= usage.max_sessions:
            raise QuotaExceeded.sessions(usage.sessions)
        if usage.context_tokens + prompt_tokens > usage.max_context_tokens:
            raise QuotaExceeded.tokens()

    # -- running (gateway.turn_engine, gateway.turn_stream) ----------------------------
    async def generate(self, turn: Turn) -> Generation:
        """Run the turn for its whole answer (`TurnEngine.generate`)."""
        return await self.engine.generate(turn)

    async def open_stream(self, turn: Turn) -> SSEStream:
        """Start the worker's stream before answering (`TurnEngine.open_stream`)."""
        return await self.engine.open_stream(turn)

    def stream(
        self,
        turn: Turn,
        upstream: SSEStream,
        shaper: Shaper,
        include_usage: bool,
        on_done: Callable[[Generation], Awaitable[dict[str, Any]]],
    ) -> AsyncGenerator[bytes, None]:
        """Relay the worker's stream; `on_done` commits (`gateway.turn_stream.relay`)."""
        return relay(
            turn,
            upstream,
            shaper,
            include_usage,
            on_done,
            pool=self.pool,
            metrics=self.metrics,
            release_now=self.release_now,
        )

    # -- ending: commit, or release ----------------------------------------------------
    async def commit(
        self,
        turn: Turn,
        gen: Generation,
        response: StoredResponse | None = None,
        answer: dict[str, Any] | None = None,
    ) -> SessionInfo:
        """Append the turn (CAS on the version we loaded, releasing our lock), with the
        `/v1/responses` object it made, if any, and with an idempotency key, the `answer`
        (without its session: a replay adds the session as this write left it)."""
        with tracing.span("ctxcache.commit", span_attributes(turn)):
            info = await self._commit(turn, gen, response, answer)
        self.metrics.turn(turn.tenant, turn.kind)
        self.metrics.completed("session", time.perf_counter() - turn.started)
        return info

    async def _commit(
        self,
        turn: Turn,
        gen: Generation,
        response: StoredResponse | None,
        answer: dict[str, Any] | None,
    ) -> SessionInfo:
        state = turn.state
        assert state is not None and turn.session_id is not None and turn.worker is not None
        if not turn.append:
            return state.info
        messages = list(turn.new_messages)
        if turn.kind == "chat":
            messages.append(gen.assistant())
        key = turn.idempotency
        try:
            info = await self.manager.append(
                turn.session_id,
                AppendTurn(
                    tenant=turn.tenant,
                    expected_version=state.info.version,
                    lock=state.lock,
                    tokens=turn.new_tokens + gen.token_ids,
                    messages=messages,
                    worker=turn.worker.id,
                    sidecar=turn.worker.sidecar,
                    model=None if state.info.model else turn.model,
                    response=response,
                    idempotency=key.model_copy(update={"answer": answer or {}}) if key else None,
                    tools=(turn.tools or []) if turn.new_tools else None,
                    replace=turn.replace,
                ),
            )
        finally:
            self.keeper.stop(state.lock)
        if turn.kind == "chat" and not self.recent.advance(
            turn.session_id, info.version, messages, info.expires_at, after=state.info.version
        ):
            history = turn.history + messages
            self.recent.put(turn.session_id, info.version, history, info.expires_at)
        with bind_session(turn.session_id):
            log.info(
                "turn %d: %d prompt tokens, %d cached, %d generated",
                info.turns,
                gen.usage["prompt_tokens"],
                cached_tokens(gen.usage),
                len(gen.token_ids),
            )
        return info

    async def release_now(self, tenant: str, state: SessionState | None) -> None:
        """Give the turn lock back before answering, so the client's next turn finds it free.

        Shielded: if this request is being cancelled, the release still completes.
        """
        task = self.release(tenant, state)
        if task is not None:
            await asyncio.shield(task)

    def release(self, tenant: str, state: SessionState | None) -> asyncio.Task[None] | None:
        """Give the turn lock back in the background (it expires by itself if this fails)."""
        if state is None or state.lock is None:
            return None
        self.keeper.stop(state.lock)
        sid = state.info.session_id
        return self.background.spawn(
            self.manager.release(sid, tenant, state.lock), what="turn lock release", session_id=sid
        )
