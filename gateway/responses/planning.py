"""Planning a response turn: the point it continues from (a stored response, a
conversation's latest, or nothing: a new chain), whether it appends to its session or forks
it, and where and how the finished response will be kept (`Planned`). Idempotency claims
and keeping the response are the service's (`gateway.responses.service`, whose module says
how continuing and forking work).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from cache_manager.client import ManagerClient
from cache_manager.keys import new_session_id
from cache_manager.protocol import (
    BeginTurn,
    Idempotency,
    Replay,
    SessionInfo,
    SessionState,
)
from ctxcache.errors import (
    ConversationNotFound,
    CtxError,
    InvalidRequest,
    PreviousResponseNotFound,
    SessionBusy,
    SessionNotFound,
    StoreUnavailable,
)
from gateway.idempotency import IdempotencyKey
from gateway.implicit.fields import NO_FIELDS, CacheFields
from gateway.implicit.finder import Located, MatchKey, StateFinder, shared_prefixes
from gateway.implicit.new import New
from gateway.locks import Held
from gateway.points import blank, cut, share_kv
from gateway.responses.items import chat_tool_choice, chat_tools, items_of, response_format
from gateway.responses.protocol import (
    ResponseCreate,
    item_id,
    new_response_id,
    parse_conversation_id,
    parse_response_id,
)
from gateway.responses.reasoning import reasoning_echo, reasoning_fields
from gateway.responses.shaping import ResponseDraft
from gateway.settings import GatewaySettings
from gateway.turn_planning import Turn
from gateway.turns import TurnService

Mode = Literal["append", "create", "none"]  # how a finished response is kept


@dataclass
class Planned:
    """A response turn, planned: the turn, and where and how its result will be kept."""

    turn: Turn
    draft: ResponseDraft
    mode: Mode
    session_id: str  # the session the response belongs to (a new one for a new chain/fork)
    history: list[dict[str, Any]]  # the messages before this turn
    messages: list[dict[str, Any]]  # this turn's: instructions (if new) and the input
    input_items: list[dict[str, Any]]
    ttl: int
    missing: CtxError  # what a session deleted under the turn answers
    parent: SessionInfo | None = None  # a fork's parent: its KV key is the fork's
    key: IdempotencyKey | None = None
    claim: Held | None = None  # mode create with a key: the claim's lock on session_id
    store: bool = True  # the response is kept (retrievable, continued by its id)
    # a request with its whole input (an implicit session, docs/implicit.md): the digest of
    # its messages, under which its state is kept with the answer's; None: not kept so
    implicit_end: str | None = None
    implicit_ttl: int = 0
    # what implicit sessions made of it (`ctxcache_gateway_implicit_total`): hit, branch,
    # shared or miss; None: not an implicit session's. A miss's prefixes others may share.
    implicit_result: str | None = None
    implicit_new: New | None = None


def with_instructions(
    instructions: str | None, history: list[dict[str, Any]], new: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`instructions` become a system message before the input unless they already are the
    context's latest system message (the usual case: a client sends the same instructions
    with every turn, and they stay where the chain started)."""
    if instructions is None:
        return new
    latest = next((m["content"] for m in reversed(history) if m["role"] == "system"), None)
    if latest == instructions:
        return new
    return [{"role": "system", "content": instructions}, *new]


def agent_fields(req: ResponseCreate) -> dict[str, Any]:
    """The request's tools, choice and format, as a chat turn takes them."""
    return {
        "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format(req.text),
    }


class ResponsePlanner:
    """Loads the point a response continues from and plans its turn there."""

    def __init__(
        self, manager: ManagerClient, turns: TurnService, settings: GatewaySettings
    ) -> None:
        self.manager = manager
        self.turns = turns
        self.settings = settings
        self.finder = StateFinder(manager, turns, settings)

    async def plan(
        self,
        tenant: str,
        req: ResponseCreate,
        key: IdempotencyKey | None,
        claim: Held | None,
        started: float,
        cache: CacheFields = NO_FIELDS,
    ) -> Planned | Replay:
        new = req.messages()
        conv = req.conversation_id
        at: dict[str, int] | None = None  # the point in the session; None: its latest
        implicit_end: str | None = None
        found: Located | None = None
        digests: list[str | None] = []
        instructed = False
        missing: CtxError = InvalidRequest("the session is gone")
        record = key.record() if key is not None else None
        loaded: SessionState | Replay
        if req.previous_response_id is not None:
            missing = PreviousResponseNotFound.of(req.previous_response_id)
            sid, at, loaded = await self._at_response(
                tenant, req.previous_response_id, req.store, record
            )
        elif conv is not None:
            missing = ConversationNotFound.of(conv, param="conversation")
            sid, loaded = await self._at_conversation(tenant, conv, req.store, record)
        else:
            sid = key.session_id() if key is not None else new_session_id()
            loaded = blank(sid, tenant, req.model)
            found, digests = await self._implicit(tenant, req, cache)
            implicit_end = digests[-1] if digests else None
            if found is not None:  # a whole input that continues a state: continued there
                sid, at, loaded = found.state.info.session_id, found.at(), found.state
                new = with_instructions(req.instructions, [], new)[found.k :]
                instructed = True  # (they were the whole input's, now in the state)
        if isinstance(loaded, Replay):  # the key's first attempt appended to this session
            return loaded
        state = loaded
        appending = state.lock is not None and (at is None or state.info.version == at["version"])
        if state.lock is not None and not appending:  # the chain moved on: fork
            await self.turns.give_back(tenant, state)
        if at is not None and not appending:
            state = cut(state, at)
        messages = new if instructed else with_instructions(req.instructions, state.messages, new)
        fields = {"max_tokens": req.max_output_tokens, "temperature": req.temperature}
        fields["top_p"] = req.top_p
        fields |= agent_fields(req)
        fields |= reasoning_fields(req)
        body = {"model": req.model, "messages": messages}
        body.update({k: v for k, v in fields.items() if v is not None})
        fork = not appending and state.info.version > 0
        keeps = req.store or implicit_end is not None  # (store: false: the state, no record)
        mode: Mode = "append" if appending else "create" if keeps else "none"
        try:
            turn = await self.turns.plan(
                tenant,
                sid,
                body,
                state,
                idempotency=record if mode == "append" else None,
                started=started,
            )
        except InvalidRequest as exc:  # (a tool message is an input item here)
            if exc.param and exc.param.startswith("messages"):
                exc.param = "input"
            elif exc.param == "reasoning_effort":  # (the chat turn's name for it)
                exc.param = "reasoning.effort"
            raise
        changes: dict[str, Any] = {}
        if req.max_output_tokens is None and turn.window:  # OpenAI's default: up to the window
            changes["sampling"] = {
                **turn.sampling,
                "max_tokens": max(1, turn.window - len(turn.prompt)),
            }
        if mode == "none" and not fork:  # nothing to find or keep: no session tag
            changes.update(session_id=None, kv_key=None)
        if changes:
            turn = dataclasses.replace(turn, **changes)
        result = _result(found, appending) if implicit_end is not None else None
        chain = None
        if result == "miss":  # (a new chain: its system prompt may be another's prefix)
            kept = cache.ttl(self.settings.implicit_ttl)
            chain = New(tenant, sid, body, digests, kept, max(kept, cache.breakpoint_ttl_s))
            chain.breakpoints = cache.breakpoints
        if mode == "append":
            target = sid
        elif fork and key is not None:
            target = key.session_id()  # a retry finds the fork its first attempt made
        elif fork or mode == "none":
            target = new_session_id()  # (store: false: only names the response)
        else:
            target = sid
        if mode == "create" and key is not None:
            assert claim is not None and target == key.session_id()  # claimed in `_plan`
        if mode == "create" and fork:
            await share_kv(self.manager, tenant, state.info)
        first = len(state.messages) + len(messages) - len(new)
        items = [it for i, m in enumerate(new) for it in items_of(m, item_id(target, first + i))]
        request = {
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "previous_response_id": req.previous_response_id,
            "conversation": {"id": conv} if conv is not None and appending else None,
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "service_tier": "default",
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": req.text or {"format": {"type": "text"}},
            "reasoning": reasoning_echo(req),
        }
        draft = ResponseDraft(
            id=new_response_id(target),
            model=req.model,
            output_id=item_id(target, len(state.messages) + len(messages)),
            request=request,
        )
        ttl = state.info.ttl if fork else self.settings.default_ttl
        if not req.store and implicit_end is not None:  # (kept only as an implicit session)
            ttl = cache.ttl(self.settings.implicit_ttl)
        return Planned(
            turn=turn,
            draft=draft,
            mode=mode,
            session_id=target,
            history=state.messages,
            messages=messages,
            input_items=items,
            ttl=ttl,
            missing=missing,
            parent=state.info if fork else None,
            key=key,
            claim=claim,
            store=req.store,
            implicit_end=implicit_end,
            implicit_ttl=cache.ttl(self.settings.implicit_ttl) if implicit_end else 0,
            implicit_result=result,
            implicit_new=chain,
        )

    async def _implicit(
        self, tenant: str, req: ResponseCreate, fields: CacheFields
    ) -> tuple[Located | None, list[str | None]]:
        """A new chain's whole input, as an implicit session's (docs/implicit.md): the
        state it continues, if any, and the digests of its messages' prefixes (none:
        implicit sessions are off for it). A store that does not answer only loses the
        match."""
        if not (fields.implicit and self.finder.on_for(tenant)):
            return None, []
        messages = with_instructions(req.instructions, [], req.messages())
        key = MatchKey(tenant, req.model, chat_tools(req.tools), fields.key)
        digests = key.digests(messages)
        try:
            found = await self.finder.locate(tenant, messages, digests, shared_prefixes(messages))
        except StoreUnavailable:
            found = None
        return found, digests

    async def _load(
        self,
        tenant: str,
        session_id: str,
        *,
        lock: bool,
        missing: CtxError,
        fork_if_busy: bool,
        idempotency: Idempotency | None = None,
    ) -> SessionState | Replay:
        """Load a session with its ids and messages (locked if `lock`); a turn in flight
        on it means a fork if the caller may fork, else `session_busy`. With an idempotency
        key whose first attempt appended to this session: that attempt's answer."""
        begin = BeginTurn(
            tenant=tenant, lock=lock, tokens=True, messages=True, idempotency=idempotency
        )
        try:
            try:
                state = await self.manager.begin(session_id, begin)
            except SessionBusy:
                if not fork_if_busy:
                    raise
                state = await self.manager.begin(
                    session_id, begin.model_copy(update={"lock": False})
                )
        except SessionNotFound:
            raise missing from None
        return state.replay if state.replay is not None else state

    async def _at_response(
        self, tenant: str, response_id: str, store: bool, idempotency: Idempotency | None = None
    ) -> tuple[str, dict[str, int], SessionState | Replay]:
        missing = PreviousResponseNotFound.of(response_id)
        parsed = parse_response_id(response_id)
        if parsed is None:
            raise missing
        sid, field = parsed
        try:
            found = await self.manager.get_response(sid, tenant, field)
        except SessionNotFound:
            raise missing from None
        at: dict[str, int] = found.record["at"]
        # a response of a conversation is continued by `conversation=`; by its id, it forks
        in_conversation = found.record["response"].get("conversation") is not None
        latest = found.version == at["version"] and not in_conversation
        state = await self._load(
            tenant,
            sid,
            lock=store and latest,
            missing=missing,
            fork_if_busy=True,
            idempotency=idempotency,
        )
        return sid, at, state

    async def _at_conversation(
        self, tenant: str, conv: str, store: bool, idempotency: Idempotency | None = None
    ) -> tuple[str, SessionState | Replay]:
        missing = ConversationNotFound.of(conv, param="conversation")
        sid = parse_conversation_id(conv)
        if sid is None:
            raise missing
        state = await self._load(
            tenant, sid, lock=store, missing=missing, fork_if_busy=False, idempotency=idempotency
        )
        if isinstance(state, Replay):
            return sid, state
        if state.info.origin != "conversation":
            await self.turns.give_back(tenant, state)
            raise missing
        return sid, state


def _result(found: Located | None, appending: bool) -> str:
    """What implicit sessions made of a whole input: a turn of its conversation's latest
    state (hit), a fork of an older one (branch), of another's shared prefix (shared), or
    a new chain (miss)."""
    if found is None:
        return "miss"
    if appending:
        return "hit"
    answered = found.state.messages[found.k - 1].get("role") == "assistant"
    return "branch" if answered else "shared"
