"""Planning a session turn: load (and lock) the session, tokenize the new input, and
build the whole prompt on a worker that serves the model.

The `/tokenize` calls start before the session is loaded (`TurnPlanner._start_early`),
so the manager's round trip and the worker's overlap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from cache_manager.client import ManagerClient
from cache_manager.protocol import BeginTurn, Idempotency, SessionState
from ctxcache import tracing
from ctxcache.errors import BackendUnavailable, InvalidRequest, SessionModelMismatch
from ctxcache.logs import bind_session
from gateway.locks import LockKeeper
from gateway.metrics import GatewayMetrics
from gateway.pool import ModelNotFound, Worker, WorkerPool
from gateway.prompts import PromptBuilder
from gateway.recent import RecentHistories
from gateway.shaping import sampling_fields
from gateway.tools import (
    Tools,
    check_agent_fields,
    check_tool_messages,
    same_tools,
    uses_chat_engine,
)
from gateway.turn_engine import TurnEngine
from gateway.turn_types import Release, Turn, check_turn_body, check_window, replayed
from gateway.upstream import WorkerDown

log = logging.getLogger(__name__)


def _consume_exception(task: asyncio.Task[Any]) -> None:
    """An early tokenize whose result nobody reads (the begin failed) logs no warning."""
    if not task.cancelled():
        task.exception()


async def _result_or_none(task: asyncio.Task[Any]) -> Any:
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.cancelled():
            return None
        raise  # this request is being cancelled
    except Exception:
        return None


@dataclass
class Early:
    """Tokenize calls started before the session was loaded (`TurnPlanner._start_early`)."""

    task: asyncio.Task[Any]
    version: int | None  # the session version a chat rendering is for; None: any
    history: list[dict[str, Any]] = field(default_factory=list)  # that version's messages
    tools: Tools | None = None  # the tools a chat rendering is for


class TurnPlanner:
    """Plans turns for `TurnService`: `begin` (load, lock, plan) and `plan` (on a loaded
    session); a plan that fails gives the session's lock back."""

    def __init__(
        self,
        manager: ManagerClient,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        prompts: PromptBuilder,
        recent: RecentHistories,
        keeper: LockKeeper,
        engine: TurnEngine,
        release_now: Release,
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.metrics = metrics
        self.prompts = prompts
        self.recent = recent
        self.keeper = keeper
        self.engine = engine
        self.release_now = release_now

    async def begin(
        self,
        tenant: str,
        session_id: str,
        kind: str,
        body: dict[str, Any],
        idempotency: Idempotency | None = None,
    ) -> Turn:
        """Load (and lock, unless `session_append` is false) the session; plan the turn.
        With `idempotency` (a turn that appends): if the key's first attempt already wrote,
        the turn only carries its answer (`Turn.replay`), and nothing is locked or run."""
        t0 = time.perf_counter()
        check_turn_body(kind, body)  # before the lock: a bad body never blocks the session
        tracing.set_session(session_id)
        append = body.get("session_append", True) is not False
        idempotency = idempotency if append else None  # a read-only turn writes nothing
        early = self._start_early(kind, session_id, body)
        try:
            state = await self.manager.begin(
                session_id,
                BeginTurn(
                    tenant=tenant,
                    lock=append,
                    tokens=True,
                    messages=kind == "chat",
                    touch=not append,
                    # a chat history this gateway holds is not sent again
                    known_version=(early and early.version) or 0,
                    idempotency=idempotency,
                ),
            )
            if state.replay is not None:
                return replayed(kind, body, tenant, session_id, state)
            turn = await self.plan(tenant, session_id, kind, body, state, early)
            turn.idempotency = idempotency
            turn.started = t0
            return turn
        finally:
            if early is not None and not early.task.done():
                early.task.cancel()

    def _start_early(self, kind: str, session_id: str, body: dict[str, Any]) -> Early | None:
        """Start the turn's `/tokenize` calls while the manager loads and locks the
        session: one round trip off the turn's latency. A completion turn's new text does
        not depend on the session. A chat turn renders from the history this gateway saw
        at the end of the session's previous turn (`gateway.recent`), if it ran it. Any
        worker serving the model tokenizes alike. If an early call fails, or the session
        moved past the version it rendered, `plan` tokenizes the usual way (errors then
        come in the usual order: an unknown session before an unknown model, and so on)."""
        model = body["model"]
        version: int | None = None
        previous: list[dict[str, Any]] = []
        if kind == "chat" and (known := self.recent.get(session_id)) is not None:
            version, previous = known
        elif kind == "chat" or not isinstance(body.get("prompt"), str):
            return None
        try:
            worker = self.pool.pick(model)
        except (ModelNotFound, BackendUnavailable):
            return None  # reported in order by `plan`

        tools = body.get("tools")  # (a turn without them renders with the session's: unknown)

        async def run() -> Any:
            async with self.pool.lease(worker):
                try:
                    return await self._tokenize(worker, kind, model, previous, body, tools)
                except WorkerDown as exc:
                    self.pool.mark_down(worker, str(exc))
                    raise

        task = asyncio.get_running_loop().create_task(run())
        task.add_done_callback(_consume_exception)
        return Early(task, version, previous, tools)

    async def plan(
        self,
        tenant: str,
        session_id: str,
        kind: str,
        body: dict[str, Any],
        state: SessionState,
        early: Early | None = None,
    ) -> Turn:
        """Plan a turn on a loaded session (`state`; a lock it holds is released if the
        plan fails). `gateway.responses` passes states of its own: a session cut at a
        stored response, to fork from it."""
        if state.lock is not None:  # renewed while the turn runs (commit or release stop it)
            self.keeper.keep(session_id, tenant, state.lock, state.lock_ttl_ms)
        try:
            info = state.info
            model = body["model"]
            if info.model and model != info.model:  # a conversation takes its first turn's model
                raise SessionModelMismatch(
                    f"this session uses model {info.model!r}, the request names {model!r}",
                    param="model",
                )
            if info.kind != kind:
                other = "/v1/chat/completions" if info.kind == "chat" else "/v1/completions"
                raise InvalidRequest(
                    f"this is a {info.kind} session: continue it on {other}", param="session_id"
                )
            new_msgs = body["messages"] if kind == "chat" else []
            ready, history = None, state.messages
            # a chat turn renders with its own tools, else with the session's (they are in
            # its prefix); other tools than the session's: the whole conversation is
            # rendered again with them, as a new prefix (docs/agents.md)
            tools = body["tools"] if body.get("tools") is not None else info.tools
            new_tools = kind == "chat" and not same_tools(tools, info.tools)
            stored = [] if new_tools else state.tokens
            if kind == "chat":
                check_agent_fields(body, tools)
            if early is not None and early.version in (None, info.version):
                if same_tools(early.tools, tools):  # (else it rendered with other tools)
                    ready = await _result_or_none(early.task)
                if early.version is not None:  # begin sent no messages: we hold this version's
                    history = early.history
            if kind == "chat":
                check_tool_messages(history, new_msgs)

            async def build(worker: Worker) -> tuple[list[int], int]:
                tokenized = ready or await self._tokenize(worker, kind, model, history, body, tools)
                if kind == "chat":
                    return await self.prompts.delta(
                        worker, model, stored, history, tokenized, tools
                    )
                return tokenized  # type: ignore[no-any-return]

            (new_tokens, window), worker = await self.engine.failover(
                model, build, affinity=info.affinity
            )
            turn = Turn(
                kind=kind,
                model=model,
                tenant=tenant,
                prompt=stored + new_tokens,
                new_tokens=new_tokens,
                new_messages=new_msgs,
                history=history,
                window=window or worker.models.get(model, 0),
                state=state,
                session_id=session_id,
                worker=worker,
                sampling=sampling_fields(body),
                kv_key=info.kv_key or None,
                tools=tools or None,
                chat_engine=kind == "chat" and uses_chat_engine(body, tools),
                new_tools=new_tools,
                replace=new_tools and bool(state.tokens),
            )
            check_window(turn)
            if turn.replace:
                self.metrics.tool_rerenders.inc()
                with bind_session(session_id):
                    log.info("turn with other tools: the history is rendered again with them")
            return turn
        except BaseException:
            await self.release_now(tenant, state)
            raise

    async def _tokenize(
        self,
        worker: Worker,
        kind: str,
        model: str,
        history: list[dict[str, Any]],
        body: dict[str, Any],
        tools: Tools | None = None,
    ) -> Any:
        """What a turn tokenizes: a completion's new prompt, or the whole chat rendered."""
        with tracing.span("ctxcache.tokenize", {"ctxcache.worker": worker.id}, client=True):
            if kind == "chat":
                new = body["messages"]
                return await self.prompts.chat_full(worker, model, history, new, tools)
            return await self.prompts.text(worker, model, body["prompt"], special=False)
