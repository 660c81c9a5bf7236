"""`/v1/responses`: OpenAI's stateful API on top of sessions (docs/responses.md).

A stored response is a point in a session's token history: its record (in the session's
`ctx:{id}:r`) says the session version, token count and message count right after it.
Continuing from a response:

* at the session's latest point: an ordinary session turn — the new input is appended
  to the stored ids (compare-and-set, turn lock), so everything before it is reused KV;
* at an older point (or while another turn holds the session): a **fork** — a new
  session whose history is the old one cut at that point plus the new turn. The
  original chain is not touched. The fork tags its KV blocks with its parent's KV key,
  so the blocks of the shared prefix are found in the sidecar as they are.

`store: false` runs the same turn and writes nothing to Redis.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Response

from cache_manager.client import ManagerClient
from cache_manager.protocol import (
    BeginTurn,
    CreateSession,
    SessionInfo,
    SessionState,
    StoredResponse,
    UpdateSession,
)
from cache_manager.store import new_session_id
from ctxcache.errors import (
    ConversationNotFound,
    CtxError,
    InvalidRequest,
    PreviousResponseNotFound,
    ResponseNotFound,
    SessionBusy,
    SessionNotFound,
)
from ctxcache.lmcache_keys import session_key
from ctxcache.logs import bind_session
from ctxcache.responses import JSONResponse
from gateway.completions.streams import SSEResponse
from gateway.metrics import GatewayMetrics
from gateway.requests import parse_json
from gateway.responses.protocol import (
    ResponseCreate,
    item_id,
    new_response_id,
    parse_conversation_id,
    parse_response_id,
)
from gateway.responses.shaping import Page, ResponseDraft, ResponseEvents, message_item
from gateway.settings import GatewaySettings
from gateway.turns import Generation, Turn, TurnService

log = logging.getLogger(__name__)

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


def cut(state: SessionState, at: dict[str, int]) -> SessionState:
    """The session as it was right after a stored response (read-only: no lock)."""
    return SessionState.model_construct(
        info=state.info,
        tokens=state.tokens[: at["tokens"]],
        messages=state.messages[: at["messages"]],
        lock=None,
    )


def blank(session_id: str, tenant: str, model: str) -> SessionState:
    """A session not created yet: a new chain starts from nothing."""
    info = SessionInfo.model_construct(
        session_id=session_id,
        tenant=tenant,
        model=model,
        kind="chat",
        version=0,
        ttl=0,
        affinity=None,
        kv_key=session_key(session_id),
        kv_shared=False,
    )
    return SessionState.model_construct(info=info, tokens=[], messages=[], lock=None)


def check_supported(req: ResponseCreate, body: dict[str, Any]) -> None:
    if req.tools:
        raise InvalidRequest("tools are not supported by this server", param="tools")
    if req.background:
        raise InvalidRequest("background responses are not supported", param="background")
    fmt = ((body.get("text") or {}).get("format") or {}).get("type", "text")
    if fmt != "text":
        raise InvalidRequest("only text output is supported", param="text.format")
    if req.previous_response_id is not None and req.conversation is not None:
        raise InvalidRequest(
            "Mutually exclusive parameters: Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            param="conversation",
        )


class ResponseService:
    def __init__(
        self,
        manager: ManagerClient,
        turns: TurnService,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
    ) -> None:
        self.manager = manager
        self.turns = turns
        self.settings = settings
        self.metrics = metrics

    # -- create -------------------------------------------------------------------------
    async def create(self, tenant: str, raw: bytes) -> Response:
        body, req = parse_json(raw, ResponseCreate)
        check_supported(req, body)
        planned = await self._plan(tenant, req)
        turn = planned.turn
        try:
            if req.stream:  # from here on, the stream releases the lock
                return await self._stream(tenant, planned)
            gen = await self.turns.generate(turn)
            final = await self._keep(tenant, planned, gen)
        except BaseException:
            await self.turns.release_now(tenant, turn.state)
            raise
        return JSONResponse(final)

    async def _stream(self, tenant: str, planned: Planned) -> Response:
        turn = planned.turn

        async def on_done(gen: Generation) -> dict[str, Any]:
            return await self._keep(tenant, planned, gen)

        upstream = await self.turns.open_stream(turn)

        async def never_started() -> None:
            await self.turns.release_now(tenant, turn.state)
            await upstream.aclose()

        shaper = ResponseEvents(planned.draft)
        return SSEResponse(self.turns.stream(turn, upstream, shaper, True, on_done), never_started)

    async def _plan(self, tenant: str, req: ResponseCreate) -> Planned:
        """Load the point the response continues from and plan the turn on it."""
        new = req.messages()
        conv = req.conversation_id
        at: dict[str, int] | None = None  # the point in the session; None: its latest
        missing: CtxError = InvalidRequest("the session is gone")
        if req.previous_response_id is not None:
            missing = PreviousResponseNotFound.of(req.previous_response_id)
            sid, at, state = await self._at_response(tenant, req.previous_response_id, req.store)
        elif conv is not None:
            missing = ConversationNotFound.of(conv, param="conversation")
            sid, state = await self._at_conversation(tenant, conv, req.store)
        else:
            sid = new_session_id()
            state = blank(sid, tenant, req.model)
        appending = state.lock is not None and (at is None or state.info.version == at["version"])
        if state.lock is not None and not appending:  # the chain moved on: fork
            await self.turns.release_now(tenant, state)
        if at is not None and not appending:
            state = cut(state, at)
        messages = with_instructions(req.instructions, state.messages, new)
        fields = {"max_tokens": req.max_output_tokens, "temperature": req.temperature}
        fields["top_p"] = req.top_p
        body = {"model": req.model, "messages": messages}
        body.update({k: v for k, v in fields.items() if v is not None})
        turn = await self.turns.plan(tenant, sid, "chat", body, state)
        if req.max_output_tokens is None and turn.window:  # OpenAI's default: up to the window
            turn.sampling["max_tokens"] = max(1, turn.window - len(turn.prompt))

        fork = not appending and state.info.version > 0
        mode: Mode = "append" if appending else "create" if req.store else "none"
        if mode == "append":
            target = sid
        elif fork or mode == "none":
            target = new_session_id()  # (store: false: only names the response)
        else:
            target = sid
        if mode == "none" and not fork:  # nothing to find or keep: no session tag
            turn.session_id, turn.kv_key = None, None
        if mode == "create" and fork:
            await self._share(tenant, state.info)
        first = len(state.messages) + len(messages) - len(new)
        items = [
            message_item(item_id(target, first + i), m["role"], m["content"])
            for i, m in enumerate(new)
        ]
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
        }
        draft = ResponseDraft(
            id=new_response_id(target),
            model=req.model,
            output_id=item_id(target, len(state.messages) + len(messages)),
            request=request,
        )
        ttl = state.info.ttl if fork else self.settings.default_ttl
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
        )

    async def _load(
        self, tenant: str, session_id: str, *, lock: bool, missing: CtxError, fork_if_busy: bool
    ) -> SessionState:
        """Load a session with its ids and messages (locked if `lock`); a turn in flight
        on it means a fork if the caller may fork, else `session_busy`."""
        begin = BeginTurn(tenant=tenant, lock=lock, tokens=True, messages=True)
        try:
            try:
                return await self.manager.begin(session_id, begin)
            except SessionBusy:
                if not fork_if_busy:
                    raise
                return await self.manager.begin(
                    session_id, begin.model_copy(update={"lock": False})
                )
        except SessionNotFound:
            raise missing from None

    async def _at_response(
        self, tenant: str, response_id: str, store: bool
    ) -> tuple[str, dict[str, int], SessionState]:
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
            tenant, sid, lock=store and latest, missing=missing, fork_if_busy=True
        )
        return sid, at, state

    async def _at_conversation(
        self, tenant: str, conv: str, store: bool
    ) -> tuple[str, SessionState]:
        missing = ConversationNotFound.of(conv, param="conversation")
        sid = parse_conversation_id(conv)
        if sid is None:
            raise missing
        state = await self._load(tenant, sid, lock=store, missing=missing, fork_if_busy=False)
        if state.info.origin != "conversation":
            await self.turns.release_now(tenant, state)
            raise missing
        return sid, state

    async def _share(self, tenant: str, parent: SessionInfo) -> None:
        """A fork reads its parent's KV blocks: mark the parent so that deleting it leaves
        them (they expire with the family's last pin)."""
        if parent.kv_shared or parent.kv_key != session_key(parent.session_id):
            return
        # (deleted meanwhile: its blocks may go, and the fork recomputes them)
        with contextlib.suppress(SessionNotFound):
            shared = UpdateSession(tenant=tenant, kv_shared=True)
            await self.manager.update(parent.session_id, shared)

    async def _keep(self, tenant: str, planned: Planned, gen: Generation) -> dict[str, Any]:
        """The finished response, stored with the turn that made it (one write)."""
        turn = planned.turn
        final = planned.draft.object(
            text=gen.text, finish_reason=gen.finish_reason, usage=gen.usage
        )
        if planned.mode == "none":
            return final
        assert turn.worker is not None
        messages = [*planned.history, *planned.messages, {"role": "assistant", "content": gen.text}]
        version = turn.state.info.version + 1 if planned.mode == "append" and turn.state else 1
        at = {
            "version": version,
            "tokens": len(turn.prompt) + len(gen.token_ids),
            "messages": len(messages),
        }
        record = {"response": final, "at": at, "input": planned.input_items}
        stored = StoredResponse(id=final["id"][-16:], record=record)
        if planned.mode == "append":
            try:
                await self.turns.commit(turn, gen, stored)
            except SessionNotFound:  # deleted while the turn ran
                raise planned.missing from None
            return final
        parent = planned.parent
        await self.manager.create(
            CreateSession(
                session_id=planned.session_id,
                tenant=tenant,
                model=turn.model,
                kind="chat",
                tokens=turn.prompt + gen.token_ids,
                messages=messages,
                ttl=planned.ttl,
                worker=turn.worker.id,
                sidecar=turn.worker.sidecar,
                origin="response",
                kv_key=parent.kv_key if parent is not None else None,
                response=stored,
            )
        )
        self.metrics.sessions_created.inc()
        with bind_session(planned.session_id):
            what = f"fork of {parent.session_id}" if parent is not None else "new chain"
            log.info("response %s: %s", final["id"], what)
        return final

    # -- retrieve, delete, input items --------------------------------------------------
    async def _record(self, tenant: str, response_id: str) -> tuple[str, str, dict[str, Any]]:
        parsed = parse_response_id(response_id)
        if parsed is None:
            raise ResponseNotFound.of(response_id)
        sid, field = parsed
        try:
            found = await self.manager.get_response(sid, tenant, field)
        except SessionNotFound:
            raise ResponseNotFound.of(response_id) from None
        return sid, field, found.record

    async def retrieve(self, tenant: str, response_id: str) -> dict[str, Any]:
        _, _, record = await self._record(tenant, response_id)
        return record["response"]  # type: ignore[no-any-return]

    async def delete(self, tenant: str, response_id: str) -> dict[str, Any]:
        """Delete a stored response. When it was the last of its chain's session (not a
        conversation's), the session goes too: its token history and, unless a fork
        reads them, its KV blocks."""
        sid, field, record = await self._record(tenant, response_id)
        try:
            left = await self.manager.delete_response(sid, tenant, field)
        except SessionNotFound:
            raise ResponseNotFound.of(response_id) from None
        if left.remaining == 0 and record["response"].get("conversation") is None:
            try:
                await self.manager.delete(sid, tenant)
                self.turns.recent.drop(sid)
            except SessionNotFound:
                pass
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, tenant: str, response_id: str, page: Page) -> dict[str, Any]:
        _, _, record = await self._record(tenant, response_id)
        return page.of(record["input"])
