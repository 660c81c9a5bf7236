"""Session turns: load + lock, build the prompt, run it on a worker, append with CAS.

A turn either commits whole (new input + generated ids + messages appended in one
compare-and-set, TTL slid, affinity recorded) or leaves the session exactly as it was:
any failure — worker error, timeout, client gone mid-stream — releases the lock and
appends nothing.

`TurnService` owns the turn from its begin to its commit or release; the endpoints'
services call it and nothing inside it: `begin` (`plan`, `plan_create`: on a session the
caller loaded, or a new one), then `run` (the whole answer) or `stream`. Either ends the
turn: `finish` (the caller's write: `commit`, or a create) or, on any failure, the turn's
lock (a `gateway.locks.Held`) and the caller's claims given back. Its parts plan
(`gateway.turn_planning`) and run (`gateway.turn_engine`) the `Turn` (`gateway.turn_kinds`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import orjson

from cache_manager.client import ManagerClient
from cache_manager.protocol import (
    AppendTurn,
    Idempotency,
    ImplicitMark,
    Replay,
    SessionInfo,
    SessionState,
    StoredResponse,
)
from ctxcache import tracing
from ctxcache.errors import BackendUnavailable, CtxError, QuotaExceeded
from ctxcache.logs import bind_session
from ctxcache.tasks import BackgroundTasks
from gateway import metering
from gateway.completions.streams import SSEResponse
from gateway.locks import NO_LOCK, Held, LockKeeper
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.prompts import PromptBuilder
from gateway.reasoning import Reasoning
from gateway.recent import Messages, RecentHistories
from gateway.salt import CacheSalt
from gateway.shaping import Shaper, cached_tokens, normalize_usage
from gateway.turn_engine import Generation, StreamedAnswer, TurnEngine, check_prompt
from gateway.turn_planning import Early, Turn, TurnPlanner, span_attributes
from gateway.upstream import SSEStream, WorkerDown

log = logging.getLogger(__name__)
T = TypeVar("T")
Finish = Callable[[Generation], Awaitable[T]]


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
        reasoning: Reasoning | None = None,
    ) -> None:
        self.manager = manager
        self.keeper = keeper if keeper is not None else LockKeeper(manager, max_hold_s=300.0)
        self.pool = pool
        self.metrics = metrics
        self.prompts = prompts
        self.recent = recent if recent is not None else RecentHistories()
        self.background = BackgroundTasks(log)
        self.engine = TurnEngine(pool, metrics, salt or CacheSalt())
        self.reasoning = reasoning or Reasoning()  # the engines' parser (docs/reasoning.md)
        self.planner = TurnPlanner(manager, pool, metrics, prompts, self.recent, self.reasoning)

    # -- locks ---------------------------------------------------------------------------
    def held(
        self,
        session_id: str,
        tenant: str,
        lock: str | None,
        ttl_ms: int | None,
        *,
        record: str | None = None,
        what: str = "turn lock release",
        wait: bool = True,
        releaser: Callable[[], Coroutine[Any, Any, Any]] | None = None,
    ) -> Held:
        """`lock` held from now on (renewed every ttl/3, `gateway.locks`): a turn's, or a
        create's idempotency claim (`what`, its release's name in the log; `wait`: a
        failure waits for the release)."""
        if lock is None:
            return NO_LOCK
        self.keeper.keep(session_id, tenant, lock, ttl_ms)
        return Held(
            self.keeper,
            self.background,
            session_id,
            tenant,
            lock,
            record=record,
            what=what,
            wait=wait,
            releaser=releaser,
        )

    async def give_back(self, tenant: str, state: SessionState) -> None:
        """Give a loaded session's lock back, before answering (a response that forks
        instead): the client's next turn finds it free."""
        if state.lock is not None:
            await self.held(state.info.session_id, tenant, state.lock, None).give_back()

    # -- planning (gateway.turn_planning) ------------------------------------------------
    async def begin(
        self,
        tenant: str,
        session_id: str,
        kind: str,
        body: dict[str, Any],
        idempotency: Idempotency | None = None,
    ) -> Turn | Replay:
        """Load (and lock, unless `session_append` is false) the session; plan the turn.
        With `idempotency` (a turn that appends): if the key's first attempt already wrote,
        its answer (`Replay`), and nothing is locked or run."""
        started = time.perf_counter()
        append = body.get("session_append", True) is not False
        idempotency = idempotency if append else None  # a read-only turn writes nothing
        early = self.planner.start(kind, session_id, body)  # (checks the body first)
        try:
            state = await self.planner.load(
                tenant, session_id, kind, append=append, idempotency=idempotency, early=early
            )
            if state.replay is not None:
                return state.replay
            return await self._plan(
                tenant, session_id, kind, body, state, early, idempotency, started, resends=True
            )
        finally:
            if early is not None:
                early.cancel()

    async def plan(
        self,
        tenant: str,
        session_id: str,
        body: dict[str, Any],
        state: SessionState,
        *,
        idempotency: Idempotency | None = None,
        started: float | None = None,
    ) -> Turn:
        """A chat turn on a session the caller loaded (`gateway.responses`: a session cut
        at a stored response, to fork from it, or locked to append to it)."""
        return await self._plan(tenant, session_id, "chat", body, state, None, idempotency, started)

    async def _plan(
        self,
        tenant: str,
        session_id: str,
        kind: str,
        body: dict[str, Any],
        state: SessionState,
        early: Early | None,
        idempotency: Idempotency | None,
        started: float | None,
        *,
        resends: bool = False,
    ) -> Turn:
        """The turn, holding the session's lock (if it took one) from here on; a plan that
        fails gives it back. `resends`: a chat completion's turn, whose messages may resend
        the session's history (`gateway.resent`)."""
        lock = self.held(session_id, tenant, state.lock, state.lock_ttl_ms)
        async with lock:
            return await self.planner.plan(
                tenant,
                session_id,
                kind,
                body,
                state,
                early,
                lock=lock,
                idempotency=idempotency,
                started=started,
                resends=resends,
            )

    async def plan_create(
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
        """A new session's first turn (`/v1/context`): nothing to lock or load."""
        return await self.planner.create(
            tenant,
            session_id,
            kind,
            body,
            model=model,
            messages=messages,
            prompt=prompt,
            max_tokens=max_tokens,
            priority=priority,
        )

    async def check_quota(self, tenant: str, prompt_tokens: int) -> None:
        """Refuse a create the tenant's quota has no room for, before any inference. The
        session's write checks again, atomically and with the answer's tokens counted; this
        read only spares the client an answer (or a stream) that could not be kept."""
        usage = await self.manager.usage(tenant)
        if usage.implicit_sessions:  # (they give way: docs/implicit.md)
            return
        if usage.sessions >= usage.max_sessions:
            raise QuotaExceeded.sessions(usage.sessions)
        if usage.context_tokens + prompt_tokens > usage.max_context_tokens:
            raise QuotaExceeded.tokens()

    # -- answering: the whole answer, or a stream ---------------------------------------
    async def run(self, turn: Turn, finish: Finish[T], *, creates: bool = False) -> T:
        """The whole answer, then `finish` (the commit, or the create, and the answer it
        makes). `creates`: the turn makes a new session, refused before anything runs if
        the tenant's quota has no room. A failure gives the turn's lock back first."""
        async with turn.lock:
            if creates:
                await self.check_quota(turn.tenant, len(turn.prompt))
            gen = await self.engine.generate(turn)
            return await finish(gen)

    async def stream(
        self,
        turn: Turn,
        shaper: Shaper,
        include_usage: bool,
        finish: Finish[dict[str, Any]],
        *,
        holds: Sequence[Held] = (),
        creates: bool = False,
        headers: dict[str, str] | None = None,
    ) -> SSEResponse:
        """The answer as it is generated, shaped by `shaper`; `finish` writes the turn
        before the final usage chunk (and returns the `session` it carries). The worker's
        stream starts before this returns (an error it answers is still an error, not a
        broken 200). From here on the stream ends the turn's lock and `holds`: released
        if it fails, is cut, or never starts."""
        try:
            if creates:
                await self.check_quota(turn.tenant, len(turn.prompt))
            upstream, call = await self.engine.open_stream(turn)
        except BaseException:
            await self._give_back(turn, holds)
            raise

        async def never_started() -> None:
            await self._give_back(turn, holds)
            await upstream.aclose()

        events = self._relay(turn, upstream, call, shaper, include_usage, finish, holds)
        return SSEResponse(events, never_started, headers=headers)

    async def _relay(
        self,
        turn: Turn,
        upstream: SSEStream,
        call: metering.EngineCall,
        shaper: Shaper,
        include_usage: bool,
        finish: Finish[dict[str, Any]],
        holds: Sequence[Held],
    ) -> AsyncGenerator[bytes, None]:
        """Stream the worker's tokens to the client; commit before the final usage chunk.

        If the client goes away (or anything fails) before the commit, the turn is
        dropped: the lock is released and nothing is appended.
        """
        committed = False
        fail = shaper.failed  # a shaper that can end a stream with an error
        try:
            if head := shaper.start():
                yield head
            async with self.pool.lease(upstream.worker):
                answer = StreamedAnswer(turn, call)
                usage: dict[str, Any] | None = None
                first = True
                async for data in upstream.events():
                    if data == b"[DONE]":  # the body ends right after it: reading it to its
                        continue  # end keeps the worker's connection for the next call
                    event = orjson.loads(data)
                    if event.get("usage") and not event.get("choices"):
                        usage = event["usage"]
                        call.done(normalize_usage(usage))  # (paid even if the commit fails)
                        continue
                    for choice in event.get("choices") or []:
                        if first:
                            seconds = time.perf_counter() - turn.started
                            self.metrics.first_token("session", seconds, streamed=True)
                            first = False
                        answer.add(choice)
                        yield shaper.content(choice)
            gen = answer.generation(usage, upstream.worker, self.metrics)
            check_prompt(turn, gen.usage)
            self.metrics.tokens(gen.usage)
            session = await finish(gen)
            committed = True
            if include_usage:
                yield shaper.usage(gen.usage, session)
            yield shaper.end
        except Exception as exc:
            if fail is None:
                raise  # the client's connection is cut: that is how its format ends badly
            error = exc
            if isinstance(exc, WorkerDown):
                self.pool.mark_down(exc.worker, str(exc))
                error = BackendUnavailable(f"the worker stopped mid-answer ({exc})")
            elif not isinstance(exc, CtxError):
                log.exception("a streamed turn failed")
            await self._give_back(turn, holds)
            committed = True  # (released: nothing left to do below)
            yield fail(error)
        finally:
            if not committed:
                await self._give_back(turn, holds)
            await upstream.aclose()

    async def _give_back(self, turn: Turn, holds: Sequence[Held]) -> None:
        """A turn that failed: its lock given back (waited for), and the caller's claims."""
        task = turn.lock.release()
        for held in holds:
            held.release()
        if task is not None:
            await asyncio.shield(task)

    # -- ending: commit ------------------------------------------------------------------
    async def commit(
        self,
        turn: Turn,
        gen: Generation,
        response: StoredResponse | None = None,
        answer: dict[str, Any] | None = None,
        implicit: ImplicitMark | None = None,
    ) -> SessionInfo:
        """Append the turn (CAS on the version we loaded, releasing our lock), with the
        `/v1/responses` object it made, if any, and with an idempotency key, the `answer`
        (without its session: a replay adds the session as this write left it);
        `implicit`: the digest of an implicit session's new state (`gateway.implicit`)."""
        with tracing.span("ctxcache.commit", span_attributes(turn, gen.worker)):
            info = await self._commit(turn, gen, response, answer, implicit)
        self.metrics.turn(turn.tenant, turn.kind)
        self.metrics.completed("session", time.perf_counter() - turn.started)
        return info

    async def _commit(
        self,
        turn: Turn,
        gen: Generation,
        response: StoredResponse | None,
        answer: dict[str, Any] | None,
        implicit: ImplicitMark | None,
    ) -> SessionInfo:
        state, worker = turn.state, gen.worker
        assert state is not None and turn.session_id is not None and worker is not None
        if not turn.append:
            return state.info
        variant = turn.variant
        messages = variant.appended(turn, gen)
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
                    worker=worker.id,
                    sidecar=worker.sidecar,
                    model=None if state.info.model else turn.model,
                    response=response,
                    idempotency=key.model_copy(update={"answer": answer or {}}) if key else None,
                    tools=(turn.tools or []) if turn.new_tools else None,
                    replace=turn.replace,
                    implicit=implicit,
                ),
            )
        finally:
            turn.lock.stop()
        variant.remember(self.recent, turn, info, messages)
        with bind_session(turn.session_id):
            if turn.rebase:
                self.metrics.reasoning_rebase(turn.rebase)
                log.info(
                    "turn %d closed the last: re-based on the template's rendering, %d "
                    "prompt tokens from the first difference on (docs/reasoning.md)",
                    info.turns,
                    turn.rebase,
                )
            log.info(
                "turn %d: %d prompt tokens, %d cached, %d generated",
                info.turns,
                gen.usage["prompt_tokens"],
                cached_tokens(gen.usage),
                len(gen.token_ids),
            )
        return info

    # -- what this gateway keeps of a session ---------------------------------------------
    def remember(self, session_id: str, version: int, messages: Messages, expires: float) -> None:
        """A new chat session's history, for its next turn (`gateway.recent`)."""
        self.recent.put(session_id, version, messages, expires)

    def forget(self, session_id: str) -> None:
        """A session deleted: its history is no longer kept here."""
        self.recent.drop(session_id)

    async def drain(self) -> None:
        """Wait for the lock releases still running in the background (shutdown, tests)."""
        await self.background.drain()
