"""Planning a session turn (`TurnPlanner`): load the session, tokenize the new input, and
build the whole prompt on a worker that serves the model: the `Turn` (defined here), built
whole and never changed after; what differs between chat and completion turns is their
kind's (`TurnKind`, `gateway.turn_kinds`).

The `/tokenize` calls start before the session is loaded (`TurnPlanner.start`), so the
manager's round trip and the worker's overlap. The turn's lock is not the planner's: the
`Held` it is given (`TurnService`) goes with the `Turn`.
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
from ctxcache.errors import (
    BackendUnavailable,
    ContextLengthExceeded,
    InvalidRequest,
    SessionModelMismatch,
)
from ctxcache.lmcache_keys import session_key
from ctxcache.logs import bind_session
from gateway.locks import NO_LOCK, Held
from gateway.metrics import GatewayMetrics
from gateway.pool import ModelNotFound, Worker, WorkerPool
from gateway.prompts import PromptBuilder, common_prefix
from gateway.reasoning import Reasoning, rebased, template_kwargs
from gateway.recent import RecentHistories
from gateway.shaping import sampling_fields
from gateway.tools import Tools, same_tools
from gateway.turn_kinds import KINDS, Messages, TurnKind
from gateway.upstream import WorkerDown, failover

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Turn:
    """A planned turn: the whole prompt, and what to append if it succeeds."""

    kind: str  # "chat" or "completion" (`KINDS`)
    model: str
    tenant: str
    prompt: list[int]
    new_tokens: list[int]  # appended before the generated ids
    new_messages: Messages
    history: Messages  # a chat session's messages before this turn
    window: int
    state: SessionState | None = None
    session_id: str | None = None
    worker: Worker | None = None  # where it was planned (the engine may fail over)
    sampling: dict[str, Any] = field(default_factory=dict)
    kv_key: str | None = None  # the tag of the KV blocks; None: the session's own key
    started: float = field(default_factory=time.perf_counter)  # for the end-to-end time
    idempotency: Idempotency | None = None  # the request's key, recorded with the append
    priority: int = 0  # vLLM's scheduling priority (lower first); 0: none sent
    tools: Tools | None = None  # the tools the prompt is rendered with, sent to the engine
    chat_engine: bool = False  # run on the engine's chat endpoint (docs/agents.md)
    new_tools: bool = False  # the session's tools change to `tools` with this turn
    # `new_tokens` are the whole history rendered again (new tools; a re-base: `rebase`)
    replace: bool = False
    rebase: int = 0  # a re-based turn's tokens from the first difference on (docs/reasoning.md)
    lock: Held = NO_LOCK  # the session's turn lock, while the turn runs

    @property
    def append(self) -> bool:
        return self.state is not None and self.state.lock is not None

    @property
    def variant(self) -> TurnKind:
        return KINDS[self.kind]

    @property
    def kv_tag(self) -> str | None:
        if self.kv_key is not None:
            return self.kv_key
        return session_key(self.session_id) if self.session_id is not None else None


def check_window(turn: Turn) -> None:
    """The prompt, and the tokens it may generate, fit the model's window; it is not empty."""
    want = int(turn.sampling.get("max_tokens") or 0)
    if turn.window and len(turn.prompt) + want > turn.window:
        raise ContextLengthExceeded(
            f"this turn needs {len(turn.prompt)} prompt tokens (session context + new "
            f"input) + {want} to generate, over the model's {turn.window}-token window",
            param=turn.variant.param,
        )
    if not turn.prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")


def span_attributes(turn: Turn, worker: Worker | None = None) -> dict[str, Any]:
    """A turn's attributes on its trace spans (generate: where it was planned; commit:
    `worker`, where it ran)."""
    worker = worker or turn.worker
    return {
        tracing.SESSION_ATTR: turn.session_id or "",
        "ctxcache.worker": worker.id if worker is not None else "",
        "ctxcache.prompt_tokens": len(turn.prompt),
    }


# a create's fields that are not the engine's
CREATE_ONLY = ("ttl", "metadata", "reasoning_history")


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
    """Tokenize calls started before the session was loaded (`TurnPlanner.start`)."""

    task: asyncio.Task[Any]
    version: int | None  # the session version a chat rendering is for; None: any
    history: Messages = field(default_factory=list)  # that version's messages
    tools: Tools | None = None  # the tools a chat rendering is for

    def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()


class TurnPlanner:
    """Plans turns for `TurnService`: `start` and `load` (the session, while the turn's
    tokenizing starts), `plan` (on a loaded session), `create` (a new session's)."""

    def __init__(
        self,
        manager: ManagerClient,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        prompts: PromptBuilder,
        recent: RecentHistories,
        reasoning: Reasoning | None = None,
    ) -> None:
        self.manager = manager
        self.pool = pool
        self.metrics = metrics
        self.prompts = prompts
        self.recent = recent
        self.reasoning = reasoning or Reasoning()

    def start(self, kind: str, session_id: str, body: dict[str, Any]) -> Early | None:
        """Check the body (before the lock: a bad body never blocks the session) and
        start the turn's early `/tokenize` (`_start_early`)."""
        KINDS[kind].check(body)
        if kind == "chat":
            self.reasoning.check(body)
        tracing.set_session(session_id)
        return self._start_early(kind, session_id, body)

    async def load(
        self,
        tenant: str,
        session_id: str,
        kind: str,
        *,
        append: bool,
        idempotency: Idempotency | None,
        early: Early | None,
    ) -> SessionState:
        """Load (and lock, if `append`) the session. With `idempotency`: if the key's
        first attempt already wrote, the state only carries its answer (`replay`)."""
        return await self.manager.begin(
            session_id,
            BeginTurn(
                tenant=tenant,
                lock=append,
                tokens=True,
                messages=KINDS[kind].messages,
                touch=not append,
                # a chat history this gateway holds is not sent again
                known_version=(early and early.version) or 0,
                idempotency=idempotency,
            ),
        )

    def _start_early(self, kind: str, session_id: str, body: dict[str, Any]) -> Early | None:
        """Start the turn's `/tokenize` calls while the manager loads and locks the
        session: one round trip off the turn's latency. A completion turn's new text does
        not depend on the session. A chat turn renders from the history this gateway saw
        at the end of the session's previous turn (`gateway.recent`), if it ran it. Any
        worker serving the model tokenizes alike. If an early call fails, or the session
        moved past the version it rendered, `plan` tokenizes the usual way (errors then
        come in the usual order: an unknown session before an unknown model, and so on)."""
        variant = KINDS[kind]
        model = body["model"]
        known = variant.early(self.recent, session_id, body)
        if known is None:
            return None
        version, previous = known
        body = variant.unsent(body, previous)  # (as `plan` takes it, on that history)
        try:
            worker = self.pool.pick(model)
        except (ModelNotFound, BackendUnavailable):
            return None  # reported in order by `plan`

        tools = body.get("tools")  # (a turn without them renders with the session's: unknown)

        async def run() -> Any:
            async with self.pool.lease(worker):
                try:
                    return await self._tokenize(worker, variant, model, previous, body, tools)
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
        *,
        lock: Held = NO_LOCK,
        idempotency: Idempotency | None = None,
        started: float | None = None,
        resends: bool = False,
    ) -> Turn:
        """Plan a turn on a loaded session (`state`, whose lock `lock` holds).
        `gateway.responses` passes states of its own: a session cut at a stored response,
        to fork from it. `resends`: the turn's messages may begin with the session's whole
        history (a chat completion's), which is then not new (`gateway.resent`)."""
        variant = KINDS[kind]
        info = state.info
        model = body["model"]
        if kind == "chat":  # (`start` checked a begin's; a caller's own state: here)
            self.reasoning.check(body)
        if info.model and model != info.model:  # a conversation takes its first turn's model
            raise SessionModelMismatch(
                f"this session uses model {info.model!r}, the request names {model!r}",
                param="model",
            )
        if info.kind != kind:
            raise InvalidRequest(
                f"this is a {info.kind} session: continue it on {KINDS[info.kind].route}",
                param="session_id",
            )
        ready, history = None, state.messages
        # a chat turn renders with its own tools, else with the session's (they are in
        # its prefix); other tools than the session's: the whole conversation is
        # rendered again with them, as a new prefix (docs/agents.md)
        tools = body["tools"] if body.get("tools") is not None else info.tools
        new_tools = variant.new_tools(tools, info.tools)
        stored = [] if new_tools else state.tokens
        variant.check_fields(body, tools)
        if early is not None and early.version in (None, info.version):
            if same_tools(early.tools, tools):  # (else it rendered with other tools)
                ready = await _result_or_none(early.task)
            if early.version is not None:  # begin sent no messages: we hold this version's
                history = early.history
        if resends:
            body = variant.unsent(body, history)
        new_msgs = variant.new_messages(body)
        variant.check_history(history, new_msgs)
        # the rule for past reasoning (docs/reasoning.md)
        rebases = kind == "chat" and not new_tools
        rebases = rebases and self.reasoning.rebases(info.reasoning_history, history, new_msgs)
        kwargs = template_kwargs(body) if kind == "chat" else None

        async def build(worker: Worker) -> tuple[list[int], int, bool]:
            tokenized = ready or await self._tokenize(worker, variant, model, history, body, tools)
            if rebases and (full := rebased(stored, tokenized[0])) is not None:
                return full, tokenized[1], True
            prompts = self.prompts
            new, window = await variant.prompt(
                prompts, worker, model, stored, history, tokenized, tools, kwargs
            )
            return new, window, False

        (new_tokens, window, rebase), worker = await failover(
            self.pool, model, build, affinity=info.affinity
        )
        if rebase:
            stored = []
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
            started=started if started is not None else time.perf_counter(),
            idempotency=idempotency,
            tools=tools or None,
            chat_engine=variant.chat_engine(body, tools) or self.reasoning.chat_engine(kind),
            new_tools=new_tools,
            replace=(new_tools or rebase) and bool(state.tokens),
            rebase=len(new_tokens) - common_prefix(new_tokens, state.tokens) if rebase else 0,
            lock=lock,
        )
        check_window(turn)
        if new_tools and turn.replace:
            self.metrics.tool_rerenders.inc()
            with bind_session(session_id):
                log.info("turn with other tools: the history is rendered again with them")
        return turn

    async def create(
        self,
        tenant: str,
        session_id: str,
        kind: str,
        body: dict[str, Any],
        *,
        model: str,
        messages: Messages,
        prompt: str | list[int] | None,
        max_tokens: int,
        priority: int,
    ) -> Turn:
        """A create's turn (`/v1/context`): its whole prompt (tokenized on a worker) and
        sampling; what it appends is the prompt, its messages and what it generates."""
        started = time.perf_counter()
        variant = KINDS[kind]
        generate = max_tokens > 0
        tools = body.get("tools") or None  # rendered into the prefix, kept with the session
        new = messages if prompt is None else prompt

        kwargs = template_kwargs(body) if kind == "chat" else None

        async def build(worker: Worker) -> tuple[list[int], int]:
            return await variant.create_prompt(
                self.prompts, worker, model, new, generate, tools, kwargs
            )

        (prompt, window), worker = await failover(self.pool, model, build)
        sampling = {k: v for k, v in sampling_fields(body).items() if k not in CREATE_ONLY}
        sampling["max_tokens"] = max_tokens  # the worker's own default is not ours (0)
        turn = Turn(
            kind=kind,
            model=model,
            tenant=tenant,
            prompt=prompt,
            new_tokens=prompt,
            new_messages=messages,
            history=[],
            window=window,
            session_id=session_id,
            worker=worker,
            sampling=sampling,
            started=started,
            priority=priority,
            tools=tools,
            chat_engine=generate
            and (variant.chat_engine(body, tools) or self.reasoning.chat_engine(kind)),
        )
        check_window(turn)
        return turn

    async def _tokenize(
        self,
        worker: Worker,
        variant: TurnKind,
        model: str,
        history: Messages,
        body: dict[str, Any],
        tools: Tools | None = None,
    ) -> Any:
        with tracing.span("ctxcache.tokenize", {"ctxcache.worker": worker.id}, client=True):
            return await variant.tokenize(self.prompts, worker, model, history, body, tools)
