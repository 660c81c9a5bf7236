"""Implicit sessions (docs/implicit.md): a chat request without a session whose messages
extend a conversation this gateway answered is served as a turn of that conversation.

- `take` says whether a request may be (the deployment's and the tenant's switch, the
  request's `prompt_cache_options.mode`, and a body a session turn renders as the engine
  would: text messages, one choice, no template of its own);
- `serve` finds the longest state of the conversation the tenant has (one store round
  trip: the digests of its prefixes that end with an answer or a shared prefix,
  `gateway.implicit.finder`), and runs the turn there: appended to the session at its
  latest state, a fork of it at an older one (a regenerated answer, a branch, an edited
  tail) or at another conversation's shared prefix. A request that matches nothing goes
  to the engine as it is (`gateway.implicit.first`), and its new session is written after
  the answer. The answer is what the client would get without ctxcache (no session in it),
  and its state is kept under the digest of the messages and the answer.

Nothing here may fail a request that the engine would have answered: a body the turn
cannot take, or a store that does not answer, is passed through as it is
(`fallback`), and an answer that cannot be kept (the quota, the session deleted under the
turn) is answered all the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Response

from cache_manager.client import ManagerClient
from cache_manager.keys import new_session_id
from cache_manager.protocol import (
    CreateSession,
    ImplicitMark,
    SessionInfo,
)
from ctxcache.errors import CtxError, InvalidRequest, SessionBusy, SessionNotFound
from ctxcache.logs import bind_session
from ctxcache.responses import JSONResponse
from gateway.completions.answers import shape
from gateway.implicit.digests import after
from gateway.implicit.fields import CacheFields, for_engine
from gateway.implicit.finder import Located, MatchKey, StateFinder, shared_prefixes
from gateway.implicit.first import FirstRequest
from gateway.implicit.new import New, NewConversations, state_ttl
from gateway.metrics import GatewayMetrics
from gateway.points import blank, cut, share_kv
from gateway.pool import WorkerPool
from gateway.prompts import PromptBuilder
from gateway.protocol import ChatBody
from gateway.requests import parse_json
from gateway.settings import GatewaySettings
from gateway.shaping import ChunkShaper
from gateway.turn_engine import Generation
from gateway.turn_planning import Turn
from gateway.turns import TurnService

log = logging.getLogger(__name__)

Messages = list[dict[str, Any]]
# the request passed through (with a `FirstRequest`: a new conversation's, its state kept)
Fallback = Callable[[FirstRequest | None], Awaitable[Response]]
Result = Literal["hit", "branch", "shared", "miss"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# fields that change how the engine renders or answers: such a request is passed through
RENDERING = (
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "add_generation_prompt",
    "documents",
    "functions",
    "function_call",
    "echo",
    "prompt_logprobs",
    "mm_processor_kwargs",
    "kv_transfer_params",
)


def allowed_tools(body: dict[str, Any]) -> bool:
    """Whether the request's tool choice is OpenAI's `allowed_tools`."""
    choice = body.get("tool_choice")
    return isinstance(choice, dict) and choice.get("type") == "allowed_tools"


def renders_alike(body: dict[str, Any]) -> bool:
    """Whether a session turn renders this request as the engine would: text messages of
    the usual roles, not ending with an answer to continue, one choice, no template or
    rendering option of its own."""
    if any(body.get(name) is not None for name in RENDERING):
        return False
    if body.get("n") not in (None, 1):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return False
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return False
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                return False
        elif content is not None and not isinstance(content, str):
            return False
    return messages[-1].get("role") != "assistant"


class ImplicitSessions:
    def __init__(
        self,
        manager: ManagerClient,
        turns: TurnService,
        pool: WorkerPool,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        prompts: PromptBuilder,
    ) -> None:
        self.manager = manager
        self.prompts = prompts
        self.turns = turns
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.finder = StateFinder(manager, turns, settings)
        self.new = NewConversations(manager, pool, settings, metrics, prompts)

    def take(self, tenant: str, body: dict[str, Any], fields: CacheFields) -> bool:
        """Whether the request is served as an implicit session (else: passed through)."""
        return fields.implicit and self.finder.on_for(tenant) and renders_alike(body)

    async def serve(
        self,
        tenant: str,
        doc: dict[str, Any],
        raw: bytes,
        fields: CacheFields,
        fallback: Fallback,
    ) -> Response:
        started = time.perf_counter()
        try:
            body, _ = parse_json(raw, ChatBody, doc)
        except CtxError:
            return await fallback(None)  # (the engine says what it makes of it)
        body = for_engine(body, fields)
        messages: Messages = body["messages"]
        salt = body.get("cache_salt")
        key = MatchKey(tenant, body["model"], body.get("tools"), fields.key, salt)
        digests = key.digests(messages)
        prefixes = shared_prefixes(messages, fields.breakpoints)
        try:
            await self.new.settled(digests)
            found = await self.finder.locate(tenant, messages, digests, prefixes)
            if found is None and not allowed_tools(body):
                self.metrics.implicit("miss")
                return await fallback(self.new.first(tenant, body, digests, fields))
            planned = await self._plan(tenant, body, messages, digests, found, fields, started)
        except (InvalidRequest, SessionBusy, SessionNotFound) as exc:
            log.info("implicit session not taken (%s): passed through", exc)
            self.metrics.implicit("passed")
            return await fallback(None)
        except CtxError as exc:  # the store, the workers: the request goes as it is
            if exc.status < 500:
                raise
            log.warning("implicit session not taken (%s): passed through", exc)
            self.metrics.implicit("passed")
            return await fallback(None)
        except Exception:  # (an engine whose /tokenize answers nonsense, say)
            log.exception("implicit session not taken: passed through")
            self.metrics.implicit("passed")
            return await fallback(None)
        self.metrics.implicit(planned.result)
        if body.get("stream"):
            return await self._stream(planned, body)

        async def finish(gen: Generation) -> dict[str, Any]:
            out = shape(planned.turn, gen, body)
            await self._keep(planned, gen)
            return out

        return JSONResponse(await self.turns.run(planned.turn, finish))

    async def _stream(self, planned: Planned, body: dict[str, Any]) -> Response:
        turn = planned.turn
        shaper = ChunkShaper("chat", turn.model, False)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def finish(gen: Generation) -> dict[str, Any]:
            await self._keep(planned, gen)
            return {}  # (no session in the usage chunk: the client named none)

        return await self.turns.stream(turn, shaper, include_usage, finish)

    async def drain(self) -> None:
        """Wait for the new conversations' writes still running (shutdown, tests)."""
        await self.new.drain()

    # -- a turn of a found state ---------------------------------------------------------------
    async def _plan(
        self,
        tenant: str,
        body: dict[str, Any],
        messages: Messages,
        digests: list[str | None],
        found: Located | None,
        fields: CacheFields,
        started: float,
    ) -> Planned:
        """The turn on the state found; with none, a new conversation's first turn (a
        request the engine would render otherwise than a session turn does: an
        `allowed_tools` choice, whose engine request renders only the allowed tools)."""
        parent: SessionInfo | None = None
        k = found.k if found is not None else 0
        if found is None:
            sid, result = new_session_id(), "miss"
            affinity = self.pool.keyed(body["model"], fields.key) if fields.key else None
            state = blank(sid, tenant, body["model"], origin="implicit", affinity=affinity)
        elif found.latest:
            state = found.state
            sid, result = state.info.session_id, "hit"
        else:  # the conversation moved on from this state (or is busy): a fork of it
            await self.turns.give_back(tenant, found.state)
            state, parent = cut(found.state, found.at()), found.state.info
            answered = messages[found.k - 1].get("role") == "assistant"  # (else: a prefix)
            sid, result = new_session_id(), "branch" if answered else "shared"
        turn_body = {**body, "messages": messages[k:]}
        turn = await self.turns.plan(
            tenant, state.info.session_id, turn_body, state, started=started
        )
        ttl = state_ttl(fields, self.settings)
        new = None
        if found is None:
            new = New(tenant, sid, body, digests, ttl, max(ttl, fields.breakpoint_ttl_s))
            new.breakpoints = fields.breakpoints
        return Planned(turn, result, sid, messages, digests, ttl, parent, new)

    async def _keep(self, planned: Planned, gen: Generation) -> None:
        """Keep the turn's state under the digest of its messages and answer. An answer
        that cannot be kept is answered all the same (the next request misses)."""
        turn = planned.turn
        answer = gen.assistant()
        messages = [*planned.messages, answer]
        end = planned.digests[-1]
        digest = after(end, answer) if end is not None else None
        mark = None
        if digest is not None:
            mark = ImplicitMark(digest=digest, messages=len(messages), ttl=planned.ttl)
        try:
            if planned.result == "hit":
                await self.turns.commit(turn, gen, implicit=mark)
                self.metrics.cached("implicit", gen.usage)
                return
            assert gen.worker is not None
            parent = planned.parent
            if parent is not None:
                await share_kv(self.manager, turn.tenant, parent)
            await self.manager.create(
                CreateSession(
                    session_id=planned.session_id,
                    tenant=turn.tenant,
                    model=turn.model,
                    kind="chat",
                    tokens=turn.prompt + gen.token_ids,
                    messages=messages,
                    tools=turn.tools,
                    ttl=planned.ttl,
                    worker=gen.worker.id,
                    sidecar=gen.worker.sidecar,
                    origin="implicit",
                    kv_key=parent.kv_key if parent is not None else None,
                    implicit=mark,
                )
            )
            self.metrics.cached("implicit" if planned.result == "branch" else "shared", gen.usage)
            self.metrics.sessions_created.inc()
        except CtxError as exc:
            self.metrics.implicit("unkept")
            with bind_session(planned.session_id):
                log.warning("implicit session: the answer was not kept (%s)", exc)
            return
        if planned.new is not None:  # (a new conversation's: its prefixes others may share)
            shared = shared_prefixes(planned.messages, planned.new.breakpoints)
            await self.new.share_prefixes(planned.new, turn.prompt, shared, turn.tools, gen.worker)


@dataclass(frozen=True)
class Planned:
    """A turn of a found state, planned: where its new state will be kept."""

    turn: Turn
    result: Result
    session_id: str  # the session the new state belongs to (a new one for a fork)
    messages: Messages  # the request's, all of them
    digests: list[str | None]  # of each prefix of them (the last: None if no state can be)
    ttl: int
    parent: SessionInfo | None = None  # a fork's
    new: New | None = None  # a new conversation's (a miss planned as a turn)
