"""`/v1/conversations`: a named, long-lived session that `responses.create(conversation=)`
appends to. Created without a model (OpenAI's conversations have none), it takes the model
of its first response; its items are the session's messages."""

from __future__ import annotations

import time
from typing import Any

from cache_manager.client import ManagerClient
from cache_manager.keys import new_session_id
from cache_manager.protocol import (
    BeginTurn,
    ClaimKey,
    CreateSession,
    EditItems,
    SessionInfo,
    SessionState,
    UpdateSession,
)
from ctxcache.errors import ConversationNotFound, NotFound, SessionNotFound, VersionConflict
from ctxcache.responses import JSONResponse
from gateway.idempotency import IdempotencyKey, answered
from gateway.metrics import GatewayMetrics
from gateway.responses.items import items_of, message_item
from gateway.responses.protocol import (
    ConversationCreate,
    InputMessage,
    conversation_id,
    item_id,
    parse_conversation_id,
)
from gateway.responses.shaping import Page
from gateway.settings import GatewaySettings
from gateway.turns import TurnService


def conversation_object(info: SessionInfo) -> dict[str, Any]:
    return {
        "id": conversation_id(info.session_id),
        "object": "conversation",
        "created_at": info.created,
        "metadata": info.metadata,
    }


class ConversationService:
    def __init__(
        self,
        manager: ManagerClient,
        turns: TurnService,
        settings: GatewaySettings,
        metrics: GatewayMetrics | None = None,
    ):
        self.manager = manager
        self.turns = turns
        self.settings = settings
        self.metrics = metrics if metrics is not None else turns.metrics

    async def create(
        self, tenant: str, req: ConversationCreate, key: IdempotencyKey | None = None
    ) -> JSONResponse:
        """A conversation lives `max_ttl` (sliding with each response); its items are not
        tokenized until its first response names the model. With an idempotency key its
        id is derived from the key, and a retry answers the conversation made first (with
        `idempotent-replayed`)."""
        session_id, lock = new_session_id(), None
        if key is not None:
            session_id = key.session_id()
            claim = await self.manager.claim(
                session_id, ClaimKey(tenant=tenant, idempotency=key.record())
            )
            if claim.replay is not None:
                self.metrics.replayed(tenant)
                return answered(claim.replay.answer, replayed=True)
            lock = claim.lock
        answer = {
            "id": conversation_id(session_id),
            "object": "conversation",
            "metadata": req.metadata or {},
        }
        # a create that fails gives its claim back, and its record with it, in the background
        record = key.name if key is not None else None
        what = "idempotency claim release"
        async with self.turns.held(
            session_id, tenant, lock, None, record=record, what=what, wait=False
        ):
            info = await self._create(tenant, req, session_id, key, lock, answer)
        return answered(conversation_object(info), replayed=False)

    async def _create(
        self,
        tenant: str,
        req: ConversationCreate,
        session_id: str,
        key: IdempotencyKey | None,
        lock: str | None,
        answer: dict[str, Any],
    ) -> SessionInfo:
        # the answer recorded for a retry: the object as it is created
        now_ms = int(time.time() * 1000)
        answer["created_at"] = now_ms // 1000
        return await self.manager.create(
            CreateSession(
                session_id=session_id,
                tenant=tenant,
                model="",
                kind="chat",
                messages=[m.as_message() for m in req.items or []],
                ttl=self.settings.max_ttl,
                metadata=req.metadata or {},
                origin="conversation",
                idempotency=key.record(answer) if key is not None else None,
                lock=lock,
                created_ms=now_ms,
            )
        )

    def _session(self, conv: str) -> str:
        sid = parse_conversation_id(conv)
        if sid is None:
            raise ConversationNotFound.of(conv)
        return sid

    async def _info(self, tenant: str, conv: str) -> SessionInfo:
        try:
            info = await self.manager.get(self._session(conv), tenant)
        except SessionNotFound:
            raise ConversationNotFound.of(conv) from None
        if info.origin != "conversation":
            raise ConversationNotFound.of(conv)
        return info

    async def retrieve(self, tenant: str, conv: str) -> dict[str, Any]:
        return conversation_object(await self._info(tenant, conv))

    async def update(self, tenant: str, conv: str, metadata: dict[str, str]) -> dict[str, Any]:
        info = await self._info(tenant, conv)
        try:
            info = await self.manager.update(
                info.session_id, UpdateSession(tenant=tenant, metadata=metadata)
            )
        except SessionNotFound:
            raise ConversationNotFound.of(conv) from None
        return conversation_object(info)

    async def delete(self, tenant: str, conv: str) -> dict[str, Any]:
        info = await self._info(tenant, conv)
        try:
            await self.manager.delete(info.session_id, tenant)
        except SessionNotFound:
            raise ConversationNotFound.of(conv) from None
        self.turns.forget(info.session_id)
        return {"id": conv, "object": "conversation.deleted", "deleted": True}

    async def _messages(self, tenant: str, conv: str) -> SessionState:
        sid = self._session(conv)
        try:
            state = await self.manager.begin(
                sid, BeginTurn(tenant=tenant, lock=False, tokens=False, messages=True)
            )
        except SessionNotFound:
            raise ConversationNotFound.of(conv) from None
        if state.info.origin != "conversation":
            raise ConversationNotFound.of(conv)
        return state

    @staticmethod
    def _item(sid: str, index: int, message: dict[str, Any]) -> dict[str, Any]:
        return message_item(item_id(sid, index), message["role"], str(message.get("content") or ""))

    @staticmethod
    def _listed(sid: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The items of the conversation's messages (a message with tool calls lists as its
        text, if any, and a function call item per call; a tool message as its output)."""
        return [it for i, m in enumerate(messages) for it in items_of(m, item_id(sid, i))]

    async def items(self, tenant: str, conv: str, page: Page) -> dict[str, Any]:
        state = await self._messages(tenant, conv)
        return page.of(self._listed(state.info.session_id, state.messages))

    async def item(self, tenant: str, conv: str, item: str) -> dict[str, Any]:
        state = await self._messages(tenant, conv)
        for listed in self._listed(state.info.session_id, state.messages):
            if listed["id"] == item:
                return listed
        raise NotFound(f"No item found with id '{item}'.", param="item_id")

    async def add_items(
        self, tenant: str, conv: str, new: list[InputMessage], key: IdempotencyKey | None = None
    ) -> JSONResponse:
        """Add items after the conversation's last (an item's id names its place). The
        session's token ids are dropped: its next response renders the conversation. With
        an idempotency key, a retry answers the items added first (`idempotent-replayed`)."""
        messages = [m.as_message() for m in new]
        for _ in range(3):  # (another edit between the read and the write: read again)
            state = await self._messages(tenant, conv)
            sid, first = state.info.session_id, len(state.messages)
            added = [self._item(sid, first + i, m) for i, m in enumerate(messages)]
            answer = {
                "object": "list",
                "data": added,
                "first_id": added[0]["id"],
                "last_id": added[-1]["id"],
                "has_more": False,
            }
            edit = EditItems(
                tenant=tenant,
                add=messages,
                expected_version=state.info.version,
                idempotency=key.record(answer) if key is not None else None,
            )
            try:
                done = await self.manager.items(sid, edit)
            except VersionConflict:
                continue
            except SessionNotFound:
                raise ConversationNotFound.of(conv) from None
            self.turns.forget(sid)
            if done.replay is not None:
                self.metrics.replayed(tenant)
                return answered(done.replay.answer, replayed=True)
            return answered(answer, replayed=False)
        raise VersionConflict("the conversation keeps changing: retry")

    async def delete_item(self, tenant: str, conv: str, item: str) -> dict[str, Any]:
        """Delete an item; the items after it move up a place (and get that place's id)."""
        for _ in range(3):
            state = await self._messages(tenant, conv)
            sid = state.info.session_id
            index = next((i for i in range(len(state.messages)) if item_id(sid, i) == item), None)
            if index is None:
                raise NotFound(f"No item found with id '{item}'.", param="item_id")
            edit = EditItems(tenant=tenant, delete=index, expected_version=state.info.version)
            try:
                done = await self.manager.items(sid, edit)
            except VersionConflict:
                continue
            except SessionNotFound:
                raise ConversationNotFound.of(conv) from None
            self.turns.forget(sid)
            assert done.info is not None
            return conversation_object(done.info)
        raise VersionConflict("the conversation keeps changing: retry")
