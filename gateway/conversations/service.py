"""`/v1/conversations`: a named, long-lived session that `responses.create(conversation=)`
appends to. Created without a model (OpenAI's conversations have none), it takes the model
of its first response; its items are the session's messages."""

from __future__ import annotations

from typing import Any

from cache_manager.client import ManagerClient
from cache_manager.protocol import BeginTurn, CreateSession, SessionInfo, UpdateSession
from cache_manager.store import new_session_id
from ctxcache.errors import ConversationNotFound, SessionNotFound
from gateway.responses.protocol import (
    ConversationCreate,
    conversation_id,
    item_id,
    parse_conversation_id,
)
from gateway.responses.shaping import Page, message_item
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
    def __init__(self, manager: ManagerClient, turns: TurnService, settings: GatewaySettings):
        self.manager = manager
        self.turns = turns
        self.settings = settings

    async def create(self, tenant: str, req: ConversationCreate) -> dict[str, Any]:
        """A conversation lives `max_ttl` (sliding with each response); its items are not
        tokenized until its first response names the model."""
        info = await self.manager.create(
            CreateSession(
                session_id=new_session_id(),
                tenant=tenant,
                model="",
                kind="chat",
                messages=[m.as_message() for m in req.items or []],
                ttl=self.settings.max_ttl,
                metadata=req.metadata or {},
                origin="conversation",
            )
        )
        return conversation_object(info)

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
        self.turns.recent.drop(info.session_id)
        return {"id": conv, "object": "conversation.deleted", "deleted": True}

    async def items(self, tenant: str, conv: str, page: Page) -> dict[str, Any]:
        sid = self._session(conv)
        try:
            state = await self.manager.begin(
                sid, BeginTurn(tenant=tenant, lock=False, tokens=False, messages=True)
            )
        except SessionNotFound:
            raise ConversationNotFound.of(conv) from None
        if state.info.origin != "conversation":
            raise ConversationNotFound.of(conv)
        items = [
            message_item(item_id(sid, i), m["role"], str(m.get("content") or ""))
            for i, m in enumerate(state.messages)
        ]
        return page.of(items)
