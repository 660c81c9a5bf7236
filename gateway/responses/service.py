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

Which point a request continues from, and whether it appends or forks, is planned in
`gateway.responses.planning` (`ResponsePlanner`); this module claims idempotency keys,
runs the planned turn and keeps its response.

With an `Idempotency-Key`, a continuation may fork or append (its chain busy, moved on or
free), and its retry may find the chain otherwise: every attempt of a key that may create a
session (a new chain, a continuation) first claims the key on the id a fork of it would
have (derived from the key). The claim runs the key's attempts one at a time and answers a
session the first attempt created; an answer the first attempt appended to the chain is
found by the chain's begin. An attempt that fails gives its claim back at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Response

from cache_manager.client import ManagerClient
from cache_manager.protocol import ClaimKey, CreateSession, ImplicitMark, Replay, StoredResponse
from ctxcache.errors import CtxError, InvalidRequest, ResponseNotFound, SessionNotFound
from ctxcache.logs import bind_session
from ctxcache.responses import JSONResponse
from gateway.completions.streams import SSEResponse
from gateway.idempotency import REPLAYED, IdempotencyKey, KeyOf
from gateway.implicit.digests import after
from gateway.implicit.fields import NO_FIELDS, CacheFields
from gateway.implicit.finder import shared_prefixes
from gateway.implicit.new import NewConversations
from gateway.locks import NO_LOCK, Held
from gateway.metrics import GatewayMetrics
from gateway.requests import parse_json
from gateway.responses.planning import Planned, ResponsePlanner
from gateway.responses.protocol import ResponseCreate, parse_response_id
from gateway.responses.reasoning import (
    check_reasoning_fields,
    check_reasoning_input,
    reasoning_of,
    reasoning_tokens,
)
from gateway.responses.shaping import Page, ResponseEvents, replay_events
from gateway.settings import GatewaySettings
from gateway.turn_engine import Generation
from gateway.turns import TurnService

log = logging.getLogger(__name__)


def check_supported(req: ResponseCreate, body: dict[str, Any]) -> None:
    if req.background:
        raise InvalidRequest("background responses are not supported", param="background")
    if req.previous_response_id is not None and req.conversation is not None:
        raise InvalidRequest(
            "Mutually exclusive parameters: Ensure you are only providing one of: "
            "'previous_response_id' or 'conversation'.",
            param="conversation",
        )


async def _events(chunks: list[bytes]) -> AsyncGenerator[bytes, None]:
    for chunk in chunks:
        yield chunk


class ResponseService:
    def __init__(
        self,
        manager: ManagerClient,
        turns: TurnService,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        new: NewConversations | None = None,
    ) -> None:
        self.manager = manager
        self.turns = turns
        self.settings = settings
        self.metrics = metrics
        self.new = new  # (implicit sessions on: keeps a new chain's shared prefixes)
        self.planner = ResponsePlanner(manager, turns, settings)

    # -- create -------------------------------------------------------------------------
    async def create(self, tenant: str, raw: bytes, key_of: KeyOf | None = None) -> Response:
        """Create a response. With an `Idempotency-Key` (a response that is stored), a
        retry answers what the first attempt answered (a stream: as a stream)."""
        body, req = parse_json(raw, ResponseCreate)
        check_supported(req, body)
        check_reasoning_fields(req, self.turns.reasoning)
        await check_reasoning_input(self.manager, tenant, req)  # (before anything is loaded)
        started = time.perf_counter()  # (the load counts, as it does for a completion's turn)
        key = key_of(raw) if key_of is not None and req.store else None
        fields = CacheFields.of(body) if b"prompt_cache" in raw else NO_FIELDS
        planned = await self._plan(tenant, req, key, started, fields)
        if isinstance(planned, Replay):
            self.metrics.replayed(tenant)
            if req.stream:
                return SSEResponse(_events(replay_events(planned.answer)), headers=REPLAYED)
            return JSONResponse(planned.answer, headers=REPLAYED)
        turn = planned.turn
        claim = planned.claim or NO_LOCK

        async def finish(gen: Generation) -> dict[str, Any]:
            return await self._keep(tenant, planned, gen)

        creates = planned.mode == "create"  # a new session: refused now if it cannot be kept
        async with claim:  # a create that fails gives its claim back (nothing was written)
            if req.stream:  # from here on, the stream ends the turn (and the claim)
                events = ResponseEvents(planned.draft)
                return await self.turns.stream(
                    turn, events, True, finish, holds=(claim,), creates=creates
                )
            final = await self.turns.run(turn, finish, creates=creates)
        return JSONResponse(final)

    async def _claim(self, tenant: str, session_id: str, key: IdempotencyKey) -> Replay | Held:
        """Claim the key on the id it derives (the session a new chain or a fork creates):
        its lock (renewed while the turn runs; given back in the background, its record
        with it, if the turn fails), or the answer of the first attempt, which created
        that session."""
        claim = await self.manager.claim(
            session_id, ClaimKey(tenant=tenant, idempotency=key.record())
        )
        if claim.replay is not None:
            return claim.replay
        lock = claim.lock
        assert lock is not None
        return self.turns.held(
            session_id,
            tenant,
            lock,
            claim.lock_ttl_ms,
            what="idempotency claim release",
            wait=False,
            releaser=lambda: self._release(tenant, key, lock),
        )

    async def _release(self, tenant: str, key: IdempotencyKey, claim: str) -> None:
        """Release a claim, and its record if it recorded nothing (it binds nothing)."""
        with contextlib.suppress(SessionNotFound):  # (ran out meanwhile)
            await self.manager.release(key.session_id(), tenant, claim, record=key.name)

    async def _plan(
        self,
        tenant: str,
        req: ResponseCreate,
        key: IdempotencyKey | None,
        started: float,
        fields: CacheFields,
    ) -> Planned | Replay:
        """Load the point the response continues from and plan the turn on it (with an
        idempotency key whose first attempt wrote: its answer). With a key, a new chain or
        a continuation claims it first (see the module); the claim is given back if the
        planning fails or finds the answer in the chain."""
        claim: Held | None = None
        if key is not None and req.conversation is None:  # (a conversation never forks)
            claimed = await self._claim(tenant, key.session_id(), key)
            if isinstance(claimed, Replay):
                return claimed
            claim = claimed
        async with claim or NO_LOCK:
            planned = await self.planner.plan(tenant, req, key, claim, started, fields)
        if claim is not None and key is not None:
            if isinstance(planned, Replay):
                # before the answer: a retry right after it finds the key free (the store
                # failing now: the claim runs out, no longer renewed)
                claim.done()
                with contextlib.suppress(CtxError):
                    await self._release(tenant, key, claim.lock or "")
            elif planned.mode == "append":
                # the chain's begin marked the key running under the chain's lock: a retry
                # finds it there (then the answer), so the claim has done its work
                claim.release()
                planned.claim = None
        return planned

    async def _keep(self, tenant: str, planned: Planned, gen: Generation) -> dict[str, Any]:
        """The finished response, stored with the turn that made it (one write)."""
        turn = planned.turn
        reasoning = reasoning_of(gen.message)
        prompts = self.turns.prompts
        counted = await reasoning_tokens(prompts, gen.worker, turn.model, gen.usage, reasoning)
        final = planned.draft.object(
            text=gen.text,
            finish_reason=gen.finish_reason,
            usage=gen.usage,
            message=gen.assistant(),
            reasoning=reasoning,
            reasoning_tokens=counted,
        )
        if planned.mode == "none":
            return final
        assert gen.worker is not None
        messages = [*planned.history, *planned.messages, gen.assistant()]
        version = turn.state.info.version + 1 if planned.mode == "append" and turn.state else 1
        at = {
            "version": version,
            "tokens": len(turn.prompt) + len(gen.token_ids),
            "messages": len(messages),
        }
        record = {"response": final, "at": at, "input": planned.input_items}
        stored = StoredResponse(id=final["id"][-16:], record=record) if planned.store else None
        mark = None
        if planned.implicit_end is not None:  # (its state: found by the next whole input)
            digest = after(planned.implicit_end, messages[-1])
            if digest is not None:
                mark = ImplicitMark(digest=digest, messages=len(messages), ttl=planned.implicit_ttl)
        if planned.mode == "append":
            try:
                await self.turns.commit(turn, gen, stored, answer=final, implicit=mark)
            except SessionNotFound:  # deleted while the turn ran
                raise planned.missing from None
            self._implicit(planned, gen)
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
                tools=turn.tools,
                ttl=planned.ttl,
                worker=gen.worker.id,
                sidecar=gen.worker.sidecar,
                origin="response" if planned.store else "implicit",
                kv_key=parent.kv_key if parent is not None else None,
                response=stored,
                implicit=mark,
                idempotency=planned.key.record(final) if planned.key is not None else None,
                lock=planned.claim.lock if planned.claim is not None else None,
            )
        )
        if planned.claim is not None:
            planned.claim.done()
        self.metrics.sessions_created.inc()
        with bind_session(planned.session_id):
            what = f"fork of {parent.session_id}" if parent is not None else "new chain"
            log.info("response %s: %s", final["id"], what)
        self._implicit(planned, gen)
        if planned.implicit_new is not None and self.new is not None:
            new = planned.implicit_new
            shared = shared_prefixes(new.body["messages"], new.breakpoints)
            await self.new.share_prefixes(new, turn.prompt, shared, turn.tools, gen.worker)
        return final

    def _implicit(self, planned: Planned, gen: Generation) -> None:
        """Count what implicit sessions made of a whole input, as for chat requests."""
        result = planned.implicit_result
        if result is None:
            return
        self.metrics.implicit(result)
        if result != "miss":
            self.metrics.cached("shared" if result == "shared" else "implicit", gen.usage)

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
                self.turns.forget(sid)
            except SessionNotFound:
                pass
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, tenant: str, response_id: str, page: Page) -> dict[str, Any]:
        _, _, record = await self._record(tenant, response_id)
        return page.of(record["input"])
