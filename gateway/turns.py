"""Session turns: load + lock, build the prompt, run it on a worker, append with CAS.

A turn either commits whole (new input + generated ids + messages appended in one
compare-and-set, TTL slid, affinity recorded) or leaves the session exactly as it was:
any failure — worker error, timeout, client gone mid-stream — releases the lock and
appends nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from cache_manager.client import ManagerClient
from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    Idempotency,
    Replay,
    SessionInfo,
    SessionState,
    StoredResponse,
)
from ctxcache import tracing
from ctxcache.errors import (
    BackendUnavailable,
    ContextLengthExceeded,
    CtxError,
    InvalidRequest,
    QuotaExceeded,
    SessionModelMismatch,
)
from ctxcache.lmcache_keys import session_key
from ctxcache.logs import bind_session
from ctxcache.tasks import BackgroundTasks
from gateway import metering
from gateway.locks import LockKeeper
from gateway.metrics import GatewayMetrics
from gateway.pool import ModelNotFound, Worker, WorkerPool
from gateway.prompts import PromptBuilder
from gateway.recent import RecentHistories
from gateway.salt import CacheSalt
from gateway.shaping import (
    Shaper,
    cached_tokens,
    normalize_usage,
    sampling_fields,
)
from gateway.tools import (
    AGENT_FIELDS,
    LEGACY_FIELDS,
    StreamedCalls,
    Tools,
    assistant_message,
    check_agent_fields,
    check_tool_messages,
    check_tools,
    same_tools,
    uses_chat_engine,
)
from gateway.upstream import SSEStream, WorkerDown, open_stream, post_json

log = logging.getLogger(__name__)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, Any]
    # from the engine's chat endpoint (a turn with tools, a format, logprobs): the answer's
    # message as the engine parsed it (content, tool_calls, ...) and its logprobs
    message: dict[str, Any] | None = None
    logprobs: Any = None

    def assistant(self) -> dict[str, Any]:
        """The assistant message the history keeps."""
        if self.message is None:
            return {"role": "assistant", "content": self.text}
        return assistant_message(self.message)


@dataclass
class Turn:
    """A planned turn: the whole prompt, and what to append if it succeeds."""

    kind: str
    model: str
    tenant: str
    prompt: list[int]
    new_tokens: list[int]  # appended before the generated ids
    new_messages: list[dict[str, Any]]
    history: list[dict[str, Any]]  # a chat session's messages before this turn
    window: int
    state: SessionState | None = None
    session_id: str | None = None
    worker: Worker | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    kv_key: str | None = None  # the tag of the KV blocks; None: the session's own key
    started: float = field(default_factory=time.perf_counter)  # for the end-to-end time
    idempotency: Idempotency | None = None  # the request's key, recorded with the append
    priority: int = 0  # vLLM's scheduling priority (lower first); 0: none sent
    engine_call: metering.EngineCall | None = None  # its stream's, for the rate limiter
    tools: Tools | None = None  # the tools the prompt is rendered with, sent to the engine
    chat_engine: bool = False  # run on the engine's chat endpoint (docs/agents.md)
    new_tools: bool = False  # the session's tools change to `tools` with this turn
    replace: bool = False  # `new_tokens` are the whole history rendered again (new tools)

    @property
    def append(self) -> bool:
        return self.state is not None and self.state.lock is not None

    @property
    def replay(self) -> Replay | None:
        """The first attempt with this turn's idempotency key wrote: answer what it did."""
        return self.state.replay if self.state is not None else None

    @property
    def kv_tag(self) -> str | None:
        if self.kv_key is not None:
            return self.kv_key
        return session_key(self.session_id) if self.session_id is not None else None


def replayed(
    kind: str, body: dict[str, Any], tenant: str, session_id: str, state: SessionState
) -> Turn:
    """A turn whose idempotency key's first attempt already wrote: nothing to run."""
    return Turn(
        kind=kind,
        model=body["model"],
        tenant=tenant,
        prompt=[],
        new_tokens=[],
        new_messages=[],
        history=[],
        window=0,
        state=state,
        session_id=session_id,
    )


def check_turn_body(kind: str, body: dict[str, Any]) -> None:
    if int(body.get("n") or 1) != 1:
        raise InvalidRequest("a session turn generates one choice: n must be 1", param="n")
    if body.get("echo"):
        raise InvalidRequest("echo is not supported on a session turn", param="echo")
    if kind == "completion":
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            raise InvalidRequest("a session turn takes one prompt, not a batch", param="prompt")
        return
    for name in LEGACY_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} is deprecated: use tools / tool_choice", param=name)
    check_tools(body.get("tools"))


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
    """Tokenize calls started before the session was loaded (`TurnService._start_early`)."""

    task: asyncio.Task[Any]
    version: int | None  # the session version a chat rendering is for; None: any
    history: list[dict[str, Any]] = field(default_factory=list)  # that version's messages
    tools: Tools | None = None  # the tools a chat rendering is for


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

    # -- planning ---------------------------------------------------------------------
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

            (new_tokens, window), worker = await self.failover(model, build, affinity=info.affinity)
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
            self.check_window(turn)
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

    def check_window(self, turn: Turn) -> None:
        want = int(turn.sampling.get("max_tokens") or 0)
        if turn.window and len(turn.prompt) + want > turn.window:
            raise ContextLengthExceeded(
                f"this turn needs {len(turn.prompt)} prompt tokens (session context + new "
                f"input) + {want} to generate, over the model's {turn.window}-token window",
                param="messages" if turn.kind == "chat" else "prompt",
            )
        if not turn.prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")

    async def check_quota(self, tenant: str, prompt_tokens: int) -> None:
        """Refuse a create the tenant's quota has no room for, before any inference. The
        session's write checks again, atomically and with the answer's tokens counted; this
        read only spares the client an answer (or a stream) that could not be kept."""
        usage = await self.manager.usage(tenant)
        if usage.sessions >= usage.max_sessions:
            raise QuotaExceeded.sessions(usage.sessions)
        if usage.context_tokens + prompt_tokens > usage.max_context_tokens:
            raise QuotaExceeded.tokens()

    # -- running ----------------------------------------------------------------------
    def _worker_body(self, turn: Turn, *, stream: bool) -> dict[str, Any]:
        """The engine request. A turn on the chat endpoint gives its prompt as token ids in
        `kv_transfer_params.prompt_token_ids` (vLLM feeds them to the engine as they are,
        rendering no messages) and its tools and format, which drive vLLM's tool parser
        and structured outputs (docs/agents.md); `messages` is then only a placeholder."""
        body: dict[str, Any] = {
            **turn.sampling,
            "model": turn.model,
            "return_token_ids": True,
            "stream": stream,
        }
        transfer: dict[str, Any] = {}
        if turn.chat_engine:
            body["messages"] = PLACEHOLDER
            body.pop("return_tokens_as_token_ids", None)
            if turn.tools:
                body["tools"] = turn.tools
            transfer["prompt_token_ids"] = turn.prompt
        else:
            body["prompt"] = turn.prompt
            if turn.kind == "chat":  # (only empty ones are left: `tools: []`, and such)
                for name in AGENT_FIELDS:
                    body.pop(name, None)
        if stream:
            body["stream_options"] = {"include_usage": True}
        if turn.kv_tag is not None:
            transfer["lmcache.tag.s"] = turn.kv_tag
        if transfer:
            body["kv_transfer_params"] = transfer
        if turn.priority:
            body["priority"] = turn.priority
        self.salt.apply(turn.tenant, body)
        return body

    async def failover(
        self,
        model: str,
        call: Callable[[Worker], Awaitable[Any]],
        *,
        affinity: str | None = None,
        first: Worker | None = None,
    ) -> tuple[Any, Worker]:
        """Run `call` on a worker; if that worker is down, on the next healthy one.

        Only a worker that could not be reached counts as down: nothing ran there, so
        running the call elsewhere is safe (the KV is recomputed there). When no healthy
        worker is left, `pick` raises `backend_unavailable`.
        """
        tried: list[str] = []
        worker = first or self.pool.pick(model, affinity=affinity)
        while True:
            try:
                async with self.pool.lease(worker):
                    return await call(worker), worker
            except WorkerDown as exc:
                self.pool.mark_down(worker, str(exc))
                tried.append(worker.id)
                worker = self.pool.pick(model, exclude=tried)
                log.info("retrying on worker %s (KV is recomputed there)", worker.id)

    async def _with_failover(self, turn: Turn, call: Callable[[Worker], Awaitable[Any]]) -> Any:
        result, turn.worker = await self.failover(turn.model, call, first=turn.worker)
        return result

    async def generate(self, turn: Turn) -> Generation:
        fields = self._worker_body(turn, stream=False)
        prefill_only = fields.get("max_tokens") == 0
        if prefill_only:
            # vLLM wants max_tokens >= 1: prefill, generate one token, and drop it (the
            # built-in worker honours 0, and gives the same answer this way).
            fields["max_tokens"] = 1
        body = orjson.dumps(fields)
        call = metering.call(len(turn.prompt))
        path = engine_path(turn)
        with (
            tracing.span("ctxcache.generate", self._span_attributes(turn), client=True),
            call,
        ):
            out = await self._with_failover(turn, lambda w: post_json(w, path, body))
        if not prefill_only:  # (a context only prefilled has no first token to wait for)
            # from the turn's start: loading the session and tokenizing count, as a client
            # waiting for its first token sees them (here with the whole answer: not streamed)
            seconds = time.perf_counter() - turn.started
            self.metrics.first_token("session", seconds, streamed=False)
        choice = (out.get("choices") or [{}])[0]
        usage = normalize_usage(out.get("usage"))
        if prefill_only:
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
            choice = {"text": "", "token_ids": [], "finish_reason": "length"}
        call.done(usage)  # charged whatever happens next (a commit that fails, say)
        self.metrics.tokens(usage)
        check_prompt(turn, usage)
        message = choice.get("message") if turn.chat_engine else None
        if message is not None:
            self.metrics.tool_calls.inc(len(message.get("tool_calls") or ()))
        text = message.get("content") if message is not None else choice.get("text")
        return Generation(
            text=text or "",
            token_ids=list(choice.get("token_ids") or []),
            finish_reason=choice.get("finish_reason"),
            usage=usage,
            message=message,
            logprobs=choice.get("logprobs"),
        )

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
        with tracing.span("ctxcache.commit", self._span_attributes(turn)):
            info = await self._commit(turn, gen, response, answer)
        self.metrics.turn(turn.tenant, turn.kind)
        self.metrics.completed("session", time.perf_counter() - turn.started)
        return info

    @staticmethod
    def _span_attributes(turn: Turn) -> dict[str, Any]:
        return {
            tracing.SESSION_ATTR: turn.session_id or "",
            "ctxcache.worker": turn.worker.id if turn.worker is not None else "",
            "ctxcache.prompt_tokens": len(turn.prompt),
        }

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

    async def open_stream(self, turn: Turn) -> SSEStream:
        """Start the worker's stream before answering: an error the worker answers (a bad
        sampling field, say) still reaches the client as an error, not a broken 200."""
        body = orjson.dumps(self._worker_body(turn, stream=True))
        call = metering.call(len(turn.prompt))
        with (
            tracing.span("ctxcache.generate", self._span_attributes(turn), client=True),
            call,
        ):
            path = engine_path(turn)
            upstream: SSEStream = await self._with_failover(
                turn, lambda w: open_stream(w, path, body)
            )
        call.streaming()  # from here on: its prompt + the tokens relayed, until its usage
        turn.engine_call = call
        return upstream

    async def stream(
        self,
        turn: Turn,
        upstream: SSEStream,
        shaper: Shaper,
        include_usage: bool,
        on_done: Callable[[Generation], Awaitable[dict[str, Any]]],
    ) -> AsyncGenerator[bytes, None]:
        """Stream the worker's tokens to the client; commit before the final usage chunk.

        If the client goes away (or anything fails) before the commit, the turn is
        dropped: the lock is released and nothing is appended.
        """
        assert turn.worker is not None
        call = turn.engine_call or metering.EngineCall()
        committed = False
        fail = getattr(shaper, "failed", None)  # a shaper that can end a stream with an error
        try:
            if head := shaper.start():
                yield head
            async with self.pool.lease(turn.worker):
                text: list[str] = []
                ids: list[int] = []
                finish: str | None = None
                usage: dict[str, Any] | None = None
                first = True
                calls = StreamedCalls()
                role: dict[str, Any] = {}  # a chat delta's other fields (reasoning, ...)
                logprobs: list[Any] = []
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
                        if turn.chat_engine:
                            delta = choice.get("delta") or {}
                            text.append(delta.get("content") or "")
                            calls.add(delta.get("tool_calls"))
                            role.update(delta)
                            if choice.get("logprobs"):
                                logprobs.append(choice["logprobs"])
                        else:
                            text.append(choice.get("text") or "")
                        ids.extend(choice.get("token_ids") or [])
                        call.relayed(len(choice.get("token_ids") or ()))
                        finish = choice.get("finish_reason") or finish
                        yield shaper.content(choice)
                gen = Generation("".join(text), ids, finish, normalize_usage(usage))
                if turn.chat_engine:
                    tool_calls = calls.list()
                    content = gen.text if gen.text or not tool_calls else None
                    gen.message = {**role, "content": content, "tool_calls": tool_calls}
                    gen.logprobs = logprobs or None
                    self.metrics.tool_calls.inc(len(tool_calls))
                check_prompt(turn, gen.usage)
                self.metrics.tokens(gen.usage)
                session = await on_done(gen)
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
            await self.release_now(turn.tenant, turn.state)
            committed = True  # (released: nothing left to do below)
            yield fail(error)
        finally:
            if not committed:
                await self.release_now(turn.tenant, turn.state)
            await upstream.aclose()


# A chat request's messages when its prompt is given as token ids: vLLM does not render them
# (it feeds `kv_transfer_params.prompt_token_ids` to the engine); a message says so in its log.
PLACEHOLDER = [{"role": "user", "content": "(ctxcache: the prompt is prompt_token_ids)"}]


def engine_path(turn: Turn) -> str:
    return "/v1/chat/completions" if turn.chat_engine else "/v1/completions"


def check_prompt(turn: Turn, usage: dict[str, Any]) -> None:
    """The engine ran the turn's own prompt. On the chat endpoint an engine that does not
    take the prompt as token ids would render the placeholder instead: such an answer is
    never appended."""
    if turn.chat_engine and usage.get("prompt_tokens") != len(turn.prompt):
        log.error(
            "the engine answered a %d-token prompt for a %d-token turn: it does not take "
            "kv_transfer_params.prompt_token_ids (vLLM >= 0.32 does)",
            usage.get("prompt_tokens"),
            len(turn.prompt),
        )
        raise BackendUnavailable("the engine did not run the session's prompt")
